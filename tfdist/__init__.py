"""tfdist: one config picks how a Keras 3 model trains across devices and machines.

Example:

    import keras, tfdist

    runner = tfdist.Runner(tfdist.load_config("mirrored"))
    with runner.scope():
        model = build_model()
        model.compile(optimizer=runner.optimizer(keras.optimizers.Adam(1e-3)),
                      loss="sparse_categorical_crossentropy")
    model.fit(runner.dataset(ds, global_batch_size=256), epochs=5,
              callbacks=runner.callbacks())
"""

import importlib
from typing import Any

from tfdist.cluster import ClusterInfo, detect_cluster
from tfdist.config import Config, Precision, Strategy, load_config
from tfdist.errors import ClusterError, ConfigError

__version__ = "0.1.0"

# Imported on first use: they import TensorFlow, and `import tfdist` alone should not
# (the `tfdist` command sets TensorFlow's log level before TensorFlow starts).
_LAZY = {"Runner": "tfdist.runner", "PrecisionPolicy": "tfdist.precision"}
# Subpackages a script reaches as `tfdist.parallel.Pipeline` after `import tfdist` alone.
_SUBPACKAGES = ("parallel", "sharding")


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    if name in _SUBPACKAGES:
        return importlib.import_module(f"tfdist.{name}")  # Sets the attribute itself.
    raise AttributeError(f"module 'tfdist' has no attribute {name!r}")


__all__ = [
    "ClusterError",
    "ClusterInfo",
    "Config",
    "ConfigError",
    "Precision",
    "PrecisionPolicy",
    "Runner",
    "Strategy",
    "detect_cluster",
    "load_config",
]
