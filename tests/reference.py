"""The reference job every equivalence test trains: fixed data, one small model, fixed start.

A distributed run and the one-device run it is compared with build both from here, so
they differ only in the strategy. Test scripts run as separate processes import it too
(they put the repository root on `sys.path`).

Example:

    features, labels = reference.examples(640)
    model = reference.make_model()
    model.set_weights(reference.initial_weights())
"""

from __future__ import annotations

import json
import os
import signal
from typing import Any, Callable, Sequence

import keras
import numpy as np

FEATURES, CLASSES, VOCABULARY = 8, 3, 40
TOLERANCE = 1e-5  # float32 weights, distributed against one device


def examples(count: int, *, seed: int = 0, embedding: bool = False,
             inf_at: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """`count` examples: features (float32, or token ids with `embedding`) and labels.

    Args:
        count: How many.
        seed: The data's seed (0 everywhere unless a test needs other data).
        embedding: Token ids in [0, VOCABULARY) instead of normal features.
        inf_at: An example whose first feature is set to inf (mixed-precision tests).
    """
    rng = np.random.RandomState(seed)
    if embedding:
        features = rng.randint(0, VOCABULARY, (count, FEATURES)).astype("int32")
    else:
        features = rng.randn(count, FEATURES).astype("float32")
    labels = rng.randint(0, CLASSES, count).astype("int32")
    if inf_at is not None:
        features[inf_at, 0] = np.inf
    return features, labels


def make_model(*, hidden: int = 16, embedding: bool = False,
               with_input: bool = True) -> keras.Model:
    """An MLP (with `embedding`, an Embedding layer in front: sparse gradients).

    The softmax is its own float32 layer under a mixed policy, so the output is float32;
    under float32 or float64 it computes in the policy's dtype. Without `with_input`, the
    model has no `keras.Input`: its layers are built, and draw their weights, on the first
    batch.
    """
    mixed = keras.config.dtype_policy().name.startswith("mixed")
    first = [keras.Input((FEATURES,), dtype="int32" if embedding else "float32")] if (
        with_input) else []
    inputs = ([*first, keras.layers.Embedding(VOCABULARY, 8, name="table"),
               keras.layers.Flatten()] if embedding else first)
    return keras.Sequential([*inputs, keras.layers.Dense(hidden, activation="relu", name="hidden"),
                             keras.layers.Dense(CLASSES, name="out"),
                             keras.layers.Activation("softmax",
                                                     dtype="float32" if mixed else None)])


def initial_weights(seed: int = 11, **model_options) -> list[np.ndarray]:
    """The weights every run of `make_model(**model_options)` starts from."""
    keras.utils.set_random_seed(seed)
    return [weight.copy() for weight in make_model(**model_options).get_weights()]


def mnist_like(count: int = 1024, seed: int = 0) -> tuple[tuple[np.ndarray, np.ndarray], None]:
    """What `keras.datasets.mnist.load_data()` returns, made here (no network): `count`
    28x28 uint8 images, label k lighting row 2 + 2k over noise, and labels; no test split.
    """
    rng = np.random.RandomState(seed)
    labels = rng.randint(0, 10, count)
    images = rng.randint(0, 80, (count, 28, 28)).astype("uint8")
    images[np.arange(count), 2 + 2 * labels, 4:24] = 255
    return (images, labels.astype("int64")), None


IMAGE_SHAPE = (6, 6, 2)


def images(count: int, *, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """`count` small images (float32, not zero-mean, so batch statistics matter) and labels."""
    rng = np.random.RandomState(seed)
    features = (rng.randn(count, *IMAGE_SHAPE) * 2.0 + 1.0).astype("float32")
    return features, rng.randint(0, CLASSES, count).astype("int32")


def make_conv_model(*, synchronized: bool = True) -> keras.Model:
    """A convolutional model with `BatchNormalization(synchronized=...)`: its output and
    its moving statistics depend on the statistics of the whole (global) batch."""
    return keras.Sequential([
        keras.Input(IMAGE_SHAPE), keras.layers.Conv2D(4, 3, name="conv"),
        keras.layers.BatchNormalization(synchronized=synchronized, momentum=0.5, name="norm"),
        keras.layers.ReLU(), keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(CLASSES, name="out"),
        keras.layers.Activation("softmax", dtype="float32")])


def initial_conv_weights(seed: int = 11) -> list[np.ndarray]:
    """The weights every run of `make_conv_model` starts from."""
    keras.utils.set_random_seed(seed)
    return [weight.copy() for weight in make_conv_model().get_weights()]


def make_optimizer(name: str = "adam") -> keras.optimizers.Optimizer:
    """SGD(0.1), or Adam(0.01): its slots and step count make the weights depend on every
    step's order and count."""
    return keras.optimizers.SGD(0.1) if name == "sgd" else keras.optimizers.Adam(0.01)


def largest_difference(weights: Sequence[np.ndarray], expected: Sequence[np.ndarray]) -> float:
    """The largest absolute difference between two lists of weights."""
    assert len(weights) == len(expected)
    return max(float(np.max(np.abs(np.asarray(a, "float64") - np.asarray(b, "float64"))))
               for a, b in zip(weights, expected))


class FirstStep(keras.callbacks.Callback):
    """The optimizer's step count when the first batch begins: after a resume has restored."""

    def __init__(self):
        super().__init__()
        self.iterations = None

    def on_train_batch_begin(self, batch, logs=None):
        if self.iterations is None:
            self.iterations = int(self.model.optimizer.iterations.numpy())


class KillAt(keras.callbacks.Callback):
    """SIGKILLs this process when `step` steps in all are done (placed after the checkpoint's
    callback, so a save due at that step is written first)."""

    def __init__(self, step):
        super().__init__()
        self.step, self.done = step, 0

    def on_train_batch_end(self, batch, logs=None):
        self.done += 1
        if self.done == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def run_variants(parse: Callable[[list[str]], Any], train: Callable[[Any], None],
                 argv: list[str]) -> None:
    """A rank script's main: `train(parse(argv))`, or with `--variants '{"NAME": [ARGS...]}'`
    each variant in turn, as if its ARGS were given alone, into OUT_DIR/NAME.

    Starting TensorFlow and Horovod on 2 ranks costs more CPU than training one small
    variant, so a test module trains all of its variants in one launch.

    Args:
        parse: The script's argument parser: a list of arguments, OUT_DIR first, to the
            parsed arguments (with `out_dir` and `variants`).
        train: The script's run for one set of parsed arguments.
        argv: The script's arguments.
    """
    args = parse(argv)
    if args.variants is None:
        train(args)
        return
    for name, variant in json.loads(args.variants).items():
        keras.backend.clear_session()
        out_dir = os.path.join(args.out_dir, name)
        os.makedirs(out_dir, exist_ok=True)
        train(parse([out_dir, *variant]))
