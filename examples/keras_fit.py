"""Your own Keras model, your own model.fit, under any tfdist strategy: copy this file.

    python examples/keras_fit.py --strategy one_device
    python examples/keras_fit.py --config mirrored --set mirrored.cpu_replicas=2
    python examples/keras_fit.py --strategy mirrored --precision mixed_bfloat16 --epochs 5
    tfdist launch -n 2 -- python examples/keras_fit.py --strategy multi_worker
    tfdist launch -n 2 --ps 1 -- python examples/keras_fit.py --strategy parameter_server
    tfdist isolate -- mpirun --allow-run-as-root -np 2 \
        python examples/keras_fit.py --strategy horovod
    tfdist launch -n 2 --max_restarts 3 -- python examples/keras_fit.py \
        --strategy multi_worker --checkpoint_dir /tmp/keras_fit_ckpt

tfdist adds --config, --strategy, --precision, --accumulation_steps, --checkpoint_dir and
--set KEY=VALUE; the script adds its own flags beside them. With --checkpoint_dir, a run
started again (after a crash, or SIGTERM, which saves and exits with status 143) goes on
from the step after its newest checkpoint. The chief prints a JSON line at the end. Bad
input prints one line, `keras_fit.py: error: ...`, and exits with status 2, as `tfdist`
does. `--set train.*` is refused: those keys are `tfdist train`'s own job; this script's
are --epochs and --global_batch_size.
"""

import json
import sys

import tfdist.quiet

# First, before TensorFlow loads: its C++ start-up and input-pipeline log lines stay off
# the console, as under `tfdist train` (TF_CPP_MIN_LOG_LEVEL=0 shows them).
tfdist.quiet.start_quietly()

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import flags, logging  # noqa: E402

import tfdist  # noqa: E402
from tfdist import flags as tfdist_flags  # noqa: E402  (defines tfdist's flags)

_EPOCHS = flags.DEFINE_integer("epochs", 3, "Passes over the training data.")
_GLOBAL_BATCH_SIZE = flags.DEFINE_integer("global_batch_size", 64,
                                          "Examples per step across all replicas.")


def make_data(num_examples: int, seed: int) -> tf.data.Dataset:
    """Unbatched (image, label) pairs: 12x12 noise with a bright quadrant as the label."""
    rng = np.random.default_rng(seed)
    images = rng.uniform(0, 0.5, (num_examples, 12, 12, 1)).astype("float32")
    labels = rng.integers(0, 4, num_examples).astype("int32")
    for index, label in enumerate(labels):
        row, col = divmod(int(label), 2)
        images[index, row * 6:(row + 1) * 6, col * 6:(col + 1) * 6] += 0.5
    return tf.data.Dataset.from_tensor_slices((images, labels))


def build_model() -> keras.Model:
    """A small CNN with BatchNormalization and Dropout."""
    return keras.Sequential([
        keras.Input((12, 12, 1)),
        keras.layers.Conv2D(16, 3, activation="relu"),
        keras.layers.BatchNormalization(),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dropout(0.2),
        keras.layers.Dense(4),
        keras.layers.Activation("softmax", dtype="float32"),  # float32 loss under mixed precision
    ])


def fail(message: str) -> None:
    """Bad input: one line and exit status 2, as the `tfdist` command does."""
    print(f"keras_fit.py: error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def main(argv):
    del argv  # Unused: everything comes in through flags.
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # absl's app.run shows INFO; --verbosity=0 does
    if _EPOCHS.value < 1:
        fail(f"--epochs must be >= 1. Received: --epochs={_EPOCHS.value}")
    # A tfdist.ConfigError (a flag, a config value, the batch size) is one line and exit
    # status 2: tfdist_flags.run below.
    fit_and_report(tfdist.Runner.from_flags())


def fit_and_report(runner: "tfdist.Runner") -> None:
    """Trains the model under `runner`; the chief prints a JSON summary."""
    if runner.config.train != tfdist.config.TrainConfig():
        raise tfdist.ConfigError("train.* keys set the job of `tfdist train`, which this "
                                 "script does not run; use its own --epochs and "
                                 "--global_batch_size")
    if runner.is_chief:
        print(runner.summary(), file=sys.stderr, flush=True)

    with runner.scope():
        model = build_model()
        model.compile(optimizer=runner.optimizer(keras.optimizers.Adam(1e-3)),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"])

    batch = _GLOBAL_BATCH_SIZE.value
    train = make_data(2048, seed=0)
    validation = make_data(256, seed=1)
    # Shuffled by the Runner, in an order fixed by (seed, epoch), so a resumed run sees
    # the batches the interrupted one would have seen.
    history = model.fit(runner.dataset(train, batch, shuffle_buffer_size=2048),
                        validation_data=runner.dataset(validation, batch, drop_remainder=False),
                        epochs=_EPOCHS.value, shuffle=False,
                        callbacks=runner.callbacks(),  # checkpoints with --checkpoint_dir
                        verbose=2 if runner.is_chief else 0)
    loss, accuracy = model.evaluate(runner.dataset(validation, batch, drop_remainder=False),
                                    verbose=0)
    if runner.is_chief:
        print(json.dumps({"strategy": runner.strategy_name.value,
                          "replicas": runner.num_replicas,
                          "precision": runner.precision.name,
                          "epochs_trained": len(history.epoch),
                          "loss": history.history.get("loss", [None])[-1],
                          "val_accuracy": history.history.get("val_accuracy", [None])[-1],
                          "evaluate_accuracy": accuracy}))


if __name__ == "__main__":
    tfdist_flags.run(main)
