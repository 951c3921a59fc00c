"""`SyncBatchNormalization`: Horovod's name for Keras 3's synchronized BatchNormalization.

Horovod's own layer cannot be built on Keras 3 (it passes `fused`, which Keras 3
refuses). Keras 3's `BatchNormalization(synchronized=True)` normalises over the
global batch: across tf.distribute replicas by itself, and across Horovod's ranks
with `tfdist.patches.keras_normalization` (applied by `tfdist.horovod.keras.init()`
and the `horovod` adapter).

Example:

    model = keras.Sequential([keras.layers.Conv2D(8, 3), hvd.SyncBatchNormalization()])
"""

from __future__ import annotations

from typing import Any

import keras

from tfdist.errors import ConfigError


@keras.saving.register_keras_serializable(package="tfdist.horovod")
class SyncBatchNormalization(keras.layers.BatchNormalization):
    """`keras.layers.BatchNormalization(synchronized=True)`, under Horovod's name.

    Args:
        fused: Only False (Horovod's layer refuses fused kernels too).
        **kwargs: `keras.layers.BatchNormalization`'s arguments.

    Example:

        layer = SyncBatchNormalization(momentum=0.9)
    """

    def __init__(self, fused: Any = False, **kwargs: Any):
        if fused in (True, None):
            raise ConfigError(f"SyncBatchNormalization does not support fused kernels (their "
                              f"statistics are per device); leave fused=False. "
                              f"Received: fused={fused!r}")
        kwargs["name"] = kwargs.get("name") or "sync_batch_normalization"
        super().__init__(synchronized=True, **kwargs)
