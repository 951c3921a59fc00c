"""Distributed training is correct only if it equals one device on the same data.

`mirrored` with 2 CPU replicas against `one_device`: same initial weights, same
unshuffled data, same global batch, 20 steps. The final weights must agree
within 1e-5, with SGD and with Adam, and with both dataset sources.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfdist.config import load_config
from tfdist.runner import Runner

GLOBAL_BATCH = 64
EXAMPLES = 640  # 10 steps per epoch
EPOCHS = 2
TOLERANCE = 1e-5


def make_examples():
    rng = np.random.RandomState(0)
    features = rng.randn(EXAMPLES, 8).astype("float32")
    labels = rng.randint(0, 3, EXAMPLES).astype("int32")
    return features, labels


def make_model():
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                             keras.layers.Dense(3, activation="softmax")])


INITIAL_WEIGHTS = None


def initial_weights():
    global INITIAL_WEIGHTS
    if INITIAL_WEIGHTS is None:
        keras.utils.set_random_seed(11)
        INITIAL_WEIGHTS = [w.copy() for w in make_model().get_weights()]
    return INITIAL_WEIGHTS


def train_weights(strategy, optimizer, source="dataset", order=None):
    features, labels = make_examples()
    if order is not None:
        features, labels = features[order], labels[order]
    start = initial_weights()
    runner = Runner(load_config(overrides={"strategy": strategy, "precision": "float32",
                                           "mirrored.cpu_replicas": 2}))
    with runner.scope():
        model = make_model()
        model.set_weights(start)
        model.compile(optimizer=runner.optimizer(optimizer), loss="sparse_categorical_crossentropy")
    dataset = tf.data.Dataset.from_tensor_slices((features, labels))
    data = dataset if source == "dataset" else (lambda context: dataset)
    history = model.fit(runner.dataset(data, GLOBAL_BATCH), epochs=EPOCHS, shuffle=False,
                        verbose=0)
    assert len(history.history["loss"]) == EPOCHS
    return runner.num_replicas, model.get_weights()


def max_difference(first, second):
    return max(float(np.max(np.abs(a - b))) for a, b in zip(first, second))


OPTIMIZERS = {"sgd": lambda: keras.optimizers.SGD(0.1), "adam": lambda: keras.optimizers.Adam(0.01)}


@pytest.mark.slow
@pytest.mark.parametrize("source", ["dataset", "function"])
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_mirrored_equals_one_device(optimizer, source):
    replicas, reference = train_weights("one_device", OPTIMIZERS[optimizer](), source)
    assert replicas == 1
    replicas, mirrored = train_weights("mirrored", OPTIMIZERS[optimizer](), source)
    assert replicas == 2
    assert max_difference(reference, initial_weights()) > 1e-2  # training moved the weights
    assert max_difference(mirrored, reference) < TOLERANCE


@pytest.mark.slow
def test_the_tolerance_detects_a_different_data_order():
    # The check above could pass vacuously if any run landed near the same weights.
    # Swapping one pair of examples between steps 0 and 1, the smallest ordering
    # mistake, moves the weights by about 1.2e-4: more than 10 times the tolerance.
    order = np.arange(EXAMPLES)
    order[[0, GLOBAL_BATCH]] = order[[GLOBAL_BATCH, 0]]
    _, reference = train_weights("one_device", OPTIMIZERS["sgd"]())
    _, swapped = train_weights("one_device", OPTIMIZERS["sgd"](), order=order)
    assert max_difference(swapped, reference) > 10 * TOLERANCE


@pytest.mark.parametrize("strategy", ["one_device", "mirrored"])
@pytest.mark.parametrize("source", ["dataset", "function"])
def test_step_i_consumes_the_examples_of_one_device_step_i(strategy, source):
    runner = Runner(load_config(overrides={"strategy": strategy, "mirrored.cpu_replicas": 2}))
    dataset = tf.data.Dataset.range(100)
    data = dataset if source == "dataset" else (lambda context: dataset)
    batches = runner.dataset(data, global_batch_size=8)
    if isinstance(batches, tf.data.Dataset):  # What Keras does with a plain dataset.
        batches = runner.strategy.experimental_distribute_dataset(batches)
    steps = []
    for batch in batches:
        parts = runner.strategy.experimental_local_results(batch)
        steps.append(np.concatenate([part.numpy() for part in parts]).tolist())
    assert steps == [list(range(8 * i, 8 * i + 8)) for i in range(12)]  # 96 of 100: full batches
