"""The mirrored adapter: devices, all-reduce choices, the CPU split, exact step counts."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfdist.devices import split_cpu
from tfdist.config import load_config
from tfdist.errors import ConfigError
from tfdist.runner import Runner

EXAMPLES, GLOBAL_BATCH, EPOCHS = 128, 32, 3  # 4 steps per epoch, 12 in all


def mirrored(**overrides):
    return Runner(load_config(overrides={"strategy": "mirrored", "mirrored.cpu_replicas": 2,
                                         **overrides}))


@pytest.mark.parametrize("choice, expected", [
    ("auto", "MirroredStrategy"), ("reduce_to_one", "ReductionToOneDevice"),
    ("hierarchical_copy", "HierarchicalCopyAllReduce")])
def test_cross_device_ops(choice, expected):
    runner = mirrored(**{"mirrored.cross_device_ops": choice})
    assert runner.num_replicas == 2
    if choice != "auto":
        assert type(runner.strategy.extended._cross_device_ops).__name__ == expected


def test_explicit_devices():
    runner = Runner(load_config(overrides={"strategy": "mirrored",
                                           "mirrored.devices": ["/cpu:0", "/cpu:1"]}))
    assert runner.num_replicas == 2


def test_more_cpu_replicas_than_the_started_runtime_has_is_a_clear_error():
    tf.constant(0.0) + 1.0  # The runtime is running, with the 2 devices conftest split.
    assert len(split_cpu(2)) == 2  # An existing split that is large enough is reused.
    with pytest.raises(ConfigError, match="cpu_replicas=4 needs 4 logical CPU devices"):
        mirrored(**{"mirrored.cpu_replicas": 4})


def _fit_and_count_updates(strategy, dataset, epochs=EPOCHS):
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, activation="softmax")])
        model.compile(keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy")
    steps = []
    counter = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: steps.append(1))
    model.fit(dataset, epochs=epochs, verbose=0, callbacks=[counter])
    return len(steps), int(model.optimizer.iterations.numpy())


def _examples():
    rng = np.random.RandomState(0)
    return tf.data.Dataset.from_tensor_slices(
        (rng.randn(EXAMPLES, 4).astype("float32"), rng.randint(0, 2, EXAMPLES).astype("int32")))


@pytest.mark.filterwarnings("ignore:Your input ran out of data")
def test_bare_stack_counts_an_extra_update_per_epoch_with_a_dataset_function():
    # Upstream behaviour that tfdist works around (see Adapter.distribute_dataset):
    # Keras 3 reads a from-function dataset's cardinality, which TensorFlow counts in
    # per-replica batches, as steps; the step past the data still bumps iterations.
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    per_replica = GLOBAL_BATCH // 2
    dataset = strategy.distribute_datasets_from_function(
        lambda context: _examples().batch(per_replica, drop_remainder=True))
    # The phantom update races with the end-of-data error, so not every epoch has one
    # (a run of 3 epochs with none failed this test once): 12 epochs make that far rarer.
    epochs = 12
    steps, iterations = _fit_and_count_updates(strategy, dataset, epochs)
    assert steps == epochs * EXAMPLES // GLOBAL_BATCH
    assert steps < iterations <= steps + epochs


def test_tfdist_counts_exactly_one_update_per_step_with_a_dataset_function():
    runner = mirrored()
    steps, iterations = _fit_and_count_updates(
        runner.strategy, runner.dataset(lambda context: _examples(), GLOBAL_BATCH))
    assert steps == EPOCHS * EXAMPLES // GLOBAL_BATCH
    assert iterations == steps


def _train_two_models_in_turn(make_strategy):
    for width in (3, 7):  # Different shapes, so reused collective keys would clash.
        strategy = make_strategy()
        with strategy.scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(width)])
            model.compile(keras.optimizers.SGD(0.1), "mse")
        features = np.ones((32, 4), "float32")
        model.fit(features, np.ones((32, width), "float32"), batch_size=16, epochs=1, verbose=0)


_BARE_TWO_STRATEGIES = """
import numpy as np, keras, tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
for width in (3, 7):
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(width)])
        model.compile(keras.optimizers.SGD(0.1), "mse")
    model.fit(np.ones((32, 4), "float32"), np.ones((32, width), "float32"), batch_size=16,
              epochs=1, verbose=0)
"""


@pytest.mark.multiprocess
def test_bare_stack_fails_on_a_second_mirrored_strategy(tmp_path):
    # In a fresh process: the collision needs two strategies with TensorFlow's keys.
    from tests.conftest import run_command
    import sys

    result = run_command([sys.executable, "-c", _BARE_TWO_STRATEGIES], cwd=tmp_path)
    assert result.returncode != 0
    assert "Shape mismatch in the collective instance" in result.stderr


def test_tfdist_trains_one_model_after_another_under_new_mirrored_strategies():
    _train_two_models_in_turn(lambda: mirrored().strategy)


@pytest.mark.parametrize("agree", [True, False])
def test_mixed_float16_inf_on_one_replica_skips_the_step_on_both(agree):
    # Keras's LossScaleOptimizer acts on the first replica's finiteness alone: an inf
    # in the second replica's half of a batch is all-reduced into the weights.
    runner = mirrored(precision="mixed_float16")
    rng = np.random.RandomState(0)
    features = rng.randn(10 * GLOBAL_BATCH, 8).astype("float32")
    labels = rng.randint(0, 3, 10 * GLOBAL_BATCH).astype("int32")
    features[3 * GLOBAL_BATCH + GLOBAL_BATCH - 1, 0] = np.inf  # step 3, the second replica
    with runner.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(3),
                                  keras.layers.Activation("softmax", dtype="float32")])
        model.compile(runner.optimizer(keras.optimizers.SGD(0.1)),
                      "sparse_categorical_crossentropy")
    if not agree:
        model.optimizer.finite_reduce_fn = None  # Keras's own decision
    model.fit(runner.dataset(tf.data.Dataset.from_tensor_slices((features, labels)),
                             GLOBAL_BATCH), epochs=1, verbose=0)
    finite = all(np.all(np.isfinite(w)) for w in model.get_weights())
    if agree:
        assert finite
        assert int(model.optimizer.iterations.numpy()) == 9
        assert float(model.optimizer.dynamic_scale.numpy()) == 2.0 ** 14
    else:
        assert not finite
