"""Loads what tests/scripts/saved_models.py saved, in a process where tfdist cannot be imported.

    python tests/scripts/saved_model_check.py OUT_DIR --variants '{"NAME": {CONFIG OVERRIDES}}'

For each variant it loads OUT_DIR/NAME/model.keras with Keras alone, serves the SavedModel
with `tf.saved_model.load`, trains the same model on one device in plain Keras for the
same epoch (the reference: one global batch of GLOBAL_BATCH x accumulation_steps a step),
then continues for one more epoch both the loaded model and a plain Keras model given the
run's own weights and optimizer state. It writes OUT_DIR/NAME/check.json: the loaded
optimizer's module, class and config, and the largest differences: loaded weights against
the trained ones and the reference's, the loaded optimizer's state against the run's and
the reference's, served outputs against `predict`'s, the two continued models, and the
model the run's own processes loaded and trained on under tfdist against them.
"""

import argparse
import importlib.abc
import json
import os
import sys


class NoTfdist(importlib.abc.MetaPathFinder):
    """Refuses to import tfdist, as a machine without it would."""

    def find_spec(self, name, path=None, target=None):
        if name == "tfdist" or name.startswith("tfdist."):
            raise ImportError(f"{name} is not importable here: the check runs without tfdist")
        return None


sys.meta_path.insert(0, NoTfdist())
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tests.scripts.saved_models import (GLOBAL_BATCH, SERVED, data, make_model,  # noqa: E402
                                        make_optimizer)


def arrays(path):
    loaded = np.load(path)
    return [loaded[f"arr_{index}"] for index in range(len(loaded.files))]


def largest(first, second):
    assert [a.shape for a in first] == [b.shape for b in second], (
        [a.shape for a in first], [b.shape for b in second])
    return max(float(np.max(np.abs(np.asarray(a, "float64") - np.asarray(b, "float64"))))
               for a, b in zip(first, second))


def plain_state(optimizer):
    """(the loss scale's own variables or [], the user's optimizer's variables)."""
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return ([v.numpy() for v in optimizer._variables],
                [v.numpy() for v in optimizer.inner_optimizer.variables])
    return [], [v.numpy() for v in optimizer.variables]


def plain_optimizer(overrides, precision):
    optimizer = make_optimizer(overrides.get("optimizer", "adam"))
    if precision == "mixed_float16":
        return keras.optimizers.LossScaleOptimizer(optimizer)
    return optimizer


def check(folder, overrides):
    precision = overrides.get("precision", "float32")
    accumulation = overrides.get("accumulation_steps", 1)
    features, targets = data()
    batch = GLOBAL_BATCH * accumulation
    keras.backend.clear_session()
    keras.config.set_dtype_policy("float32")
    loaded = keras.saving.load_model(os.path.join(folder, "model.keras"))
    optimizer = loaded.optimizer
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    result = {"module": type(optimizer).__module__, "class": type(optimizer).__name__,
              "inner_class": type(inner).__name__, "config": inner.get_config(),
              "iterations": int(inner.iterations.numpy()),
              "weights": largest(loaded.get_weights(), arrays(os.path.join(folder,
                                                                           "trained.npz")))}
    own, state = plain_state(optimizer)
    result["state_vs_run"] = largest(state, arrays(os.path.join(folder, "state.npz")))
    if os.path.exists(os.path.join(folder, "loss_scale.npz")):
        result["loss_scale_vs_run"] = largest(own, arrays(os.path.join(folder,
                                                                       "loss_scale.npz")))
    if os.path.isdir(os.path.join(folder, "export")):
        served = tf.saved_model.load(os.path.join(folder, "export"))
        outputs = served.serve(tf.constant(features[:SERVED])).numpy()
        result["served"] = largest([outputs], arrays(os.path.join(folder, "predictions.npz")))

    # One device, plain Keras, the same global batches: the state the run should reach.
    if precision != "float32":
        keras.config.set_dtype_policy(precision)
    reference = make_model()
    reference.compile(plain_optimizer(overrides, precision), "mse")
    reference.fit(features, targets, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    result["weights_vs_one_device"] = largest(loaded.get_weights(), reference.get_weights())
    result["state_vs_one_device"] = largest(state, plain_state(reference.optimizer)[1])

    # The run's own state, on one device in plain Keras: what continuing it there gives.
    continued = make_model()
    continued.set_weights(arrays(os.path.join(folder, "trained.npz")))
    continued.compile(plain_optimizer(overrides, precision), "mse")
    continued.optimizer.build(continued.trainable_variables)
    run_state = arrays(os.path.join(folder, "state.npz"))
    if precision == "mixed_float16":
        run_state = arrays(os.path.join(folder, "loss_scale.npz")) + run_state
    for variable, value in zip(continued.optimizer.variables, run_state, strict=True):
        variable.assign(value)

    # Both go on for an epoch: the loaded model as a user elsewhere would.
    loaded.fit(features, targets, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    continued.fit(features, targets, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    result["continued"] = largest(loaded.get_weights(), continued.get_weights())
    # The run's processes loaded the file under tfdist and trained on the same epoch.
    result["resumed"] = largest(arrays(os.path.join(folder, "resumed.npz")),
                                continued.get_weights())
    result["tfdist_imported"] = any(name.startswith("tfdist") for name in sys.modules)
    with open(os.path.join(folder, "check.json"), "w") as file:
        json.dump(result, file)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--variants", required=True)
    args = parser.parse_args()
    for name, overrides in json.loads(args.variants).items():
        check(os.path.join(args.out, name), overrides)


if __name__ == "__main__":
    main()
