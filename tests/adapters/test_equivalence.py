"""Distributed training is correct only if it equals one device on the same data.

`mirrored` with 2 CPU replicas against `one_device`: same initial weights, same
unshuffled data, same global batch, 20 steps. The final weights must agree
within 1e-5, with SGD and with Adam, and with both dataset sources.
"""

import functools

import numpy as np
import pytest
import tensorflow as tf

from tests import reference
from tests.reference import TOLERANCE
from tfdist.config import load_config
from tfdist.runner import Runner

GLOBAL_BATCH = 64
EXAMPLES = 640  # 10 steps per epoch
EPOCHS = 2


def train_weights(strategy, optimizer, source="dataset", order=None):
    features, labels = reference.examples(EXAMPLES)
    if order is not None:
        features, labels = features[order], labels[order]
    start = reference.initial_weights()
    runner = Runner(load_config(overrides={"strategy": strategy, "precision": "float32",
                                           "mirrored.cpu_replicas": 2}))
    with runner.scope():
        model = reference.make_model()
        model.set_weights(start)
        model.compile(optimizer=runner.optimizer(optimizer), loss="sparse_categorical_crossentropy")
    dataset = tf.data.Dataset.from_tensor_slices((features, labels))
    data = dataset if source == "dataset" else (lambda context: dataset)
    history = model.fit(runner.dataset(data, GLOBAL_BATCH), epochs=EPOCHS, shuffle=False,
                        verbose=0)
    assert len(history.history["loss"]) == EPOCHS
    return runner.num_replicas, model.get_weights()


max_difference = reference.largest_difference
OPTIMIZERS = {name: functools.partial(reference.make_optimizer, name) for name in ("sgd", "adam")}


@pytest.mark.parametrize("source", ["dataset", "function"])
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_mirrored_equals_one_device(optimizer, source):
    replicas, expected = train_weights("one_device", OPTIMIZERS[optimizer](), source)
    assert replicas == 1
    replicas, mirrored = train_weights("mirrored", OPTIMIZERS[optimizer](), source)
    assert replicas == 2
    # Training moved the weights.
    assert max_difference(expected, reference.initial_weights()) > 1e-2
    assert max_difference(mirrored, expected) < TOLERANCE


def test_the_tolerance_detects_a_different_data_order():
    # The check above could pass vacuously if any run landed near the same weights.
    # Swapping one pair of examples between steps 0 and 1, the smallest ordering
    # mistake, moves the weights by about 1.2e-4: more than 10 times the tolerance.
    order = np.arange(EXAMPLES)
    order[[0, GLOBAL_BATCH]] = order[[GLOBAL_BATCH, 0]]
    _, expected = train_weights("one_device", OPTIMIZERS["sgd"]())
    _, swapped = train_weights("one_device", OPTIMIZERS["sgd"](), order=order)
    assert max_difference(swapped, expected) > 10 * TOLERANCE


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
