"""Trains one epoch under each given setting, then saves, exports and describes the model.

Run by tests/test_saved_models.py: alone (one_device, mirrored), under `tfdist launch -n 2`
(multi_worker), `tfdist launch -n 1 --ps 1` (parameter_server) or `mpirun -np 2`
(horovod); every variant of a launch trains in the same processes, one after another:

    python tests/scripts/saved_models.py OUT_DIR --variants '{"NAME": {CONFIG OVERRIDES}}'

Each variant's config overrides may also name "optimizer": "adam" (default) or
"sgd_momentum". On the chief, for variant NAME:

- OUT_DIR/NAME/model.keras: `model.save` after the epoch;
- OUT_DIR/NAME/export/: `model.export` (a SavedModel), or export_error in the report;
- OUT_DIR/NAME/trained.npz: the weights; predictions.npz: `predict` on the first examples;
- OUT_DIR/NAME/state.npz: the state of the user's optimizer inside tfdist's wrappers, in
  plain Keras's order (whole at zero stages 1-3), and loss_scale.npz: the loss scale's
  own variables (mixed_float16);
- OUT_DIR/NAME/report.json: the optimizer's class as tfdist trains it (written last);
- OUT_DIR/NAME/resumed.npz: the weights after every process loaded model.keras under
  `runner.scope()`, compiled it with `runner.optimizer(loaded.optimizer)` and trained
  one more epoch.

tests/scripts/saved_model_check.py then reads them where tfdist cannot be imported.
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import keras  # noqa: E402
import numpy as np  # noqa: E402

EXAMPLES, GLOBAL_BATCH = 96, 16  # 6 steps an epoch: 3 updates with accumulation_steps 2
FEATURES, OUTPUTS, HIDDEN = 8, 4, 16
SERVED = 8  # examples `predict` and the SavedModel are compared on


def data():
    rng = np.random.default_rng(7)
    features = rng.standard_normal((EXAMPLES, FEATURES)).astype("float32")
    targets = rng.standard_normal((EXAMPLES, OUTPUTS)).astype("float32")
    return features, targets


def initial_weights():
    rng = np.random.default_rng(11)
    return [rng.standard_normal((FEATURES, HIDDEN)).astype("float32") * 0.3,
            np.zeros((HIDDEN,), "float32"),
            rng.standard_normal((HIDDEN, OUTPUTS)).astype("float32") * 0.3,
            np.zeros((OUTPUTS,), "float32")]


def make_model():
    model = keras.Sequential([keras.Input((FEATURES,)),
                              keras.layers.Dense(HIDDEN, activation="tanh", name="hidden"),
                              keras.layers.Dense(OUTPUTS, name="out",
                                                 dtype="float32")])  # float32 outputs
    model.set_weights(initial_weights())
    return model


def make_optimizer(name):
    return {"adam": lambda: keras.optimizers.Adam(0.01),
            "sgd_momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9)}[name]()


def train(runner, folder, optimizer_name):
    import tensorflow as tf

    features, targets = data()
    dataset = runner.dataset(tf.data.Dataset.from_tensor_slices((features, targets)),
                             global_batch_size=GLOBAL_BATCH)
    with runner.scope():
        model = make_model()
        model.compile(runner.optimizer(make_optimizer(optimizer_name)), "mse")
    model.fit(dataset, epochs=1, verbose=0)
    # Every rank predicts (at zero_stage 3 each read of a weight is a collective).
    predictions = model.predict(features[:SERVED], verbose=0)
    if runner.is_chief:
        save(model, folder, predictions)
    else:
        wait_for(os.path.join(folder, "report.json"))
    # Every process loads the chief's file under the strategy and trains on from it.
    path = os.path.join(folder, "model.keras")
    if runner.config.zero_stage == 3:
        # Stage 3 stores weights as slices from their creation: the file is loaded plain,
        # and the model made again under the strategy (docs/guide/saving.md).
        plain = keras.saving.load_model(path)
        with runner.scope():
            resumed = type(plain).from_config(plain.get_config())  # not compiled
            resumed.set_weights(plain.get_weights())
            resumed.compile(runner.optimizer(plain.optimizer), "mse")
    else:
        with runner.scope():
            resumed = keras.saving.load_model(path)
            resumed.compile(runner.optimizer(resumed.optimizer), "mse")
    resumed.fit(dataset, epochs=1, verbose=0)
    weights = resumed.get_weights()
    if runner.is_chief:
        np.savez(os.path.join(folder, "resumed.npz"), *weights)


def wait_for(path, bound_seconds=120):
    """Waits until the chief has written `path` (the last of its files)."""
    deadline = time.monotonic() + bound_seconds
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the chief wrote no {path} in {bound_seconds} s")
        time.sleep(0.1)


def save(model, folder, predictions):
    """The chief's files (see the module docstring); report.json last."""
    from tfdist.optimizers import user_optimizer

    os.makedirs(folder, exist_ok=True)
    report = {"class": type(model.optimizer).__name__}
    model.save(os.path.join(folder, "model.keras"))
    try:
        model.export(os.path.join(folder, "export"), verbose=False)
    except Exception as error:  # noqa: BLE001 (reported: the test says where it may fail)
        report["export_error"] = f"{type(error).__name__}: {error}"[:500]
    np.savez(os.path.join(folder, "trained.npz"), *model.get_weights())
    np.savez(os.path.join(folder, "predictions.npz"), predictions)
    # The user's optimizer's state as this run holds it (whole, as the chief keeps it at
    # the end of fit at zero stages 1-3), in plain Keras's order.
    inner = model.optimizer
    if isinstance(inner, keras.optimizers.LossScaleOptimizer):
        np.savez(os.path.join(folder, "loss_scale.npz"), *[v.numpy() for v in inner._variables])
        inner = inner.inner_optimizer
    state = {}
    user_optimizer(inner).save_own_variables(state)
    np.savez(os.path.join(folder, "state.npz"), *[state[str(i)] for i in range(len(state))])
    with open(os.path.join(folder, "report.json.tmp"), "w") as file:
        json.dump(report, file)
    os.replace(os.path.join(folder, "report.json.tmp"), os.path.join(folder, "report.json"))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--variants", required=True)
    args = parser.parse_args()

    import tfdist

    for name, overrides in json.loads(args.variants).items():
        overrides = dict(overrides)
        optimizer_name = overrides.pop("optimizer", "adam")
        keras.backend.clear_session()
        keras.config.set_dtype_policy("float32")
        runner = tfdist.Runner(tfdist.load_config(overrides={"seed": 0, **overrides}))
        train(runner, os.path.join(args.out, name), optimizer_name)


if __name__ == "__main__":
    main()
