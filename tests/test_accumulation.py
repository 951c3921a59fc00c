"""Gradient accumulation under one_device and mirrored (2 CPU replicas), in this process.

multi_worker and horovod are tested with real processes in tests/adapters/.
"""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tests.reference import examples as reference_examples
from tests.reference import (TOLERANCE, initial_weights, largest_difference, make_model,
                             make_optimizer)
from tfdist.accumulation import AccumulatingOptimizer

EXAMPLES, MICRO_BATCH, STEPS = 256, 16, 4  # 16 micro-batches, 4 updates per epoch


def examples(inf_at_micro_batch=None):
    inf_at = None if inf_at_micro_batch is None else (inf_at_micro_batch + 1) * MICRO_BATCH - 1
    # The last row of a micro-batch: the second replica's half under mirrored.
    return tf.data.Dataset.from_tensor_slices(reference_examples(EXAMPLES, inf_at=inf_at))


def build(strategy, steps, optimizer, precision="float32", start=None, float64=False):
    """A compiled model under a fresh Runner (with `float64`, its layers in float64):
    (runner, model)."""
    keras.backend.clear_session()
    overrides = {"strategy": strategy, "accumulation_steps": steps, "precision": precision}
    if strategy == "mirrored":
        overrides["mirrored.cpu_replicas"] = 2
    runner = tfdist.Runner(tfdist.load_config(overrides=overrides))
    with runner.scope():
        if float64:  # (the scope restores the precision's policy after it)
            keras.config.set_dtype_policy("float64")
        model = make_model()
        model.set_weights(initial_weights() if start is None else start)
        made = make_optimizer(optimizer)
        model.compile(runner.optimizer(made), "sparse_categorical_crossentropy")
    return runner, model


def trained(strategy, steps, batch, optimizer, epochs=2, **kwargs):
    runner, model = build(strategy, steps, optimizer, **kwargs)
    model.fit(runner.dataset(examples(), batch), epochs=epochs, verbose=0)
    return model


max_difference = largest_difference


@pytest.mark.parametrize("strategy", ["one_device", "mirrored"])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.slow
def test_k_micro_batches_equal_one_batch_k_times_larger(strategy, optimizer):
    reference = trained("one_device", 1, STEPS * MICRO_BATCH, optimizer)
    accumulated = trained(strategy, STEPS, MICRO_BATCH, optimizer)
    assert int(accumulated.optimizer.iterations.numpy()) == 8  # updates, not micro-batches
    assert max_difference(reference.get_weights(), initial_weights()) > 1e-2
    assert max_difference(accumulated.get_weights(), reference.get_weights()) < TOLERANCE


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_a_float64_model_accumulates_in_float64(optimizer):
    keras.config.set_floatx("float64")  # Keras's losses compute in floatx
    try:
        reference = trained("one_device", 1, STEPS * MICRO_BATCH, optimizer, float64=True)
        accumulated = trained("one_device", STEPS, MICRO_BATCH, optimizer, float64=True)
    finally:
        keras.config.set_floatx("float32")
    assert reference.get_weights()[0].dtype == np.float64
    accumulators = accumulated.optimizer._accumulator.accumulators
    assert {keras.backend.standardize_dtype(a.dtype) for a in accumulators} == {"float64"}
    # (float32 accumulators round each sum: 2.5e-8 apart with Adam, measured at stage 3.)
    assert max_difference(accumulated.get_weights(), reference.get_weights()) < 1e-14


class CountingSGD(keras.optimizers.SGD):
    """SGD that counts its cross-replica gradient reductions (once per replica each)."""

    reductions = None  # a tf.Variable, set by the test (the optimizer is re-created from config)

    def _all_reduce_sum_gradients(self, grads_and_vars):
        # Keras calls this once more for gradients tfdist has summed already
        # (tfdist.patches.keras_optimizer), and gets them back as they are.
        grads_and_vars = list(grads_and_vars)
        summed = super()._all_reduce_sum_gradients(grads_and_vars)
        if any(new is not old for (new, _), (old, _) in zip(summed, grads_and_vars)):
            CountingSGD.reductions.assign_add(1)
        return summed


@pytest.mark.parametrize("steps", [1, STEPS])
def test_one_cross_replica_reduction_per_update(steps):
    CountingSGD.reductions = tf.Variable(0, dtype=tf.int64, trainable=False)
    runner = tfdist.Runner(tfdist.load_config(overrides={
        "strategy": "mirrored", "mirrored.cpu_replicas": 2, "accumulation_steps": steps}))
    with runner.scope():
        model = make_model()
        model.compile(runner.optimizer(CountingSGD(0.1)), "sparse_categorical_crossentropy")
    model.fit(runner.dataset(examples(), MICRO_BATCH), epochs=1, verbose=0)
    updates = (EXAMPLES // MICRO_BATCH) // steps
    assert int(model.optimizer.iterations.numpy()) == updates
    assert int(CountingSGD.reductions.numpy()) == updates * runner.num_replicas


@pytest.mark.parametrize("strategy", ["one_device", "mirrored"])
@pytest.mark.slow
def test_mixed_float16_inf_in_one_micro_batch_skips_its_whole_cycle(strategy):
    runner, model = build(strategy, STEPS, "sgd", precision="mixed_float16")
    model.fit(runner.dataset(examples(inf_at_micro_batch=5), MICRO_BATCH), epochs=1, verbose=0)
    optimizer = model.optimizer
    assert int(optimizer.iterations.numpy()) == 3  # 4 cycles, the second skipped
    assert float(optimizer.dynamic_scale.numpy()) == 2.0 ** 14
    assert all(np.all(np.isfinite(w)) for w in model.get_weights())
    # The skipped cycle leaves nothing behind: the same as training without its
    # micro-batches (4 to 7).
    runner, reference = build(strategy, STEPS, "sgd", precision="mixed_float16")
    without = examples().take(4 * MICRO_BATCH).concatenate(examples().skip(8 * MICRO_BATCH))
    reference.fit(runner.dataset(without, MICRO_BATCH), epochs=1, verbose=0)
    assert int(reference.optimizer.iterations.numpy()) == 3
    assert max_difference(model.get_weights(), reference.get_weights()) < TOLERANCE


@pytest.mark.parametrize("strategy", ["one_device", "mirrored"])
@pytest.mark.slow
def test_a_resume_in_the_middle_of_a_cycle_equals_no_interruption(strategy, tmp_path):
    uninterrupted = trained(strategy, STEPS, MICRO_BATCH, "adam", epochs=1)
    runner, model = build(strategy, STEPS, "adam")
    model.fit(runner.dataset(examples(), MICRO_BATCH).take(6), epochs=1, verbose=0)
    path = tf.train.Checkpoint(model=model, optimizer=model.optimizer).write(
        os.path.join(tmp_path, "checkpoint"))
    runner, resumed = build(strategy, STEPS, "adam", start=[w * 0 for w in initial_weights()])
    with runner.scope():
        resumed.optimizer.build(resumed.trainable_variables)
    tf.train.Checkpoint(model=resumed, optimizer=resumed.optimizer).read(
        path).assert_existing_objects_matched()
    assert int(resumed.optimizer.inner_optimizer.iterations.numpy()) == 1  # 6 = 4 + 2
    resumed.fit(runner.dataset(examples(), MICRO_BATCH).skip(6), epochs=1, verbose=0)
    assert max_difference(resumed.get_weights(), uninterrupted.get_weights()) < TOLERANCE


def test_a_cycle_carries_over_the_end_of_an_epoch():
    runner, model = build("one_device", 3, "sgd")
    model.fit(runner.dataset(examples(), MICRO_BATCH), epochs=2, verbose=0)
    # 2 x 16 micro-batches: 10 updates, and 2 micro-batches waiting for the next fit.
    assert int(model.optimizer.iterations.numpy()) == 10
    assert int(model.optimizer.micro_batches.numpy()) == 2


def test_the_wrapper_saves_as_the_users_optimizer_and_loads_as_it(tmp_path):
    runner, model = build("one_device", STEPS, "adam")
    model.fit(runner.dataset(examples(), MICRO_BATCH).take(6), epochs=1, verbose=0)
    model.save(tmp_path / "model.keras")
    loaded = keras.models.load_model(tmp_path / "model.keras")
    # Saved as the user's optimizer, as plain Keras loads it: 1 update of 4 micro-batches;
    # the 2 micro-batches of the cycle in progress stay out of the file (docs/guide/saving.md).
    assert type(loaded.optimizer) is keras.optimizers.Adam
    assert int(loaded.optimizer.iterations.numpy()) == 1
    inner = model.optimizer.inner_optimizer
    assert len(loaded.optimizer.variables) == len(inner.variables)
    for saved, trained in zip(loaded.optimizer.variables, inner.variables):
        np.testing.assert_array_equal(saved.numpy(), trained.numpy())


def test_keras_own_accumulation_fails_under_mirrored():
    # keras-team/keras#20582: Keras's gradient_accumulation_steps under MirroredStrategy.
    runner = tfdist.Runner(tfdist.load_config(overrides={
        "strategy": "mirrored", "mirrored.cpu_replicas": 2}))
    with runner.scope():
        model = make_model()
        model.compile(keras.optimizers.SGD(0.1, gradient_accumulation_steps=STEPS),
                      "sparse_categorical_crossentropy")
    with pytest.raises(RuntimeError):
        model.fit(runner.dataset(examples(), MICRO_BATCH), epochs=1, verbose=0)


def test_steps_must_be_a_positive_integer():
    with pytest.raises(ValueError, match="steps must be an integer >= 1"):
        AccumulatingOptimizer(keras.optimizers.SGD(0.1), steps=0)
    with pytest.raises(tfdist.ConfigError, match="accumulation_steps must be an integer >= 1"):
        tfdist.load_config(overrides={"accumulation_steps": 0})


@pytest.mark.multiprocess
def test_tfdist_train_reports_the_micro_and_the_effective_batch(tmp_path):
    from tests.conftest import TFDIST, last_json_line, run_command

    result = run_command([TFDIST, "train", "--strategy=mirrored", "--accumulation_steps=4",
                          "--set", "mirrored.cpu_replicas=2", "--set", "train.epochs=2",
                          "--set", "train.global_batch_size=16"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = last_json_line(result.stdout)
    assert (summary["accumulation_steps"], summary["global_batch_size"],
            summary["effective_batch_size"]) == (4, 16, 64)
    assert summary["accuracy"] > 0.5


@pytest.mark.slow
def test_the_update_decided_in_replica_context_without_a_strategy():
    # With no strategy in scope TensorFlow needs no merge call, so the cycle's update is
    # decided by a cond in replica context: the path XLA-compiled steps on GPUs take
    # under mirrored and multi_worker (every other test here takes the merge-call path).
    keras.backend.clear_session()
    assert tf.__internal__.distribute.strategy_supports_no_merge_call()
    model = make_model()
    model.set_weights(initial_weights())
    model.compile(AccumulatingOptimizer(keras.optimizers.Adam(0.01), steps=STEPS),
                  "sparse_categorical_crossentropy")
    model.fit(examples().batch(MICRO_BATCH), epochs=2, shuffle=False, verbose=0)
    reference = trained("one_device", 1, STEPS * MICRO_BATCH, "adam")
    assert int(model.optimizer.iterations.numpy()) == 8
    assert max_difference(model.get_weights(), reference.get_weights()) < TOLERANCE
