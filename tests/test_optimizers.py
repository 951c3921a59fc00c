"""The optimizer wrappers and the learning-rate schedule, on one device with real Keras."""

import copy

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tfdist.accumulation import AccumulatingOptimizer
from tfdist.optimizers import AgreeingLossScaleOptimizer, GradientReducingOptimizer
from tfdist.schedules import ScaledWarmup


def data():
    rng = np.random.RandomState(0)
    return rng.randn(64, 4).astype("float32"), rng.randn(64, 1).astype("float32")


def train(optimizer, steps=4):
    """Fits a linear model from fixed weights; returns (weights, model)."""
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer, "mse")
    features, targets = data()
    model.fit(features, targets, batch_size=64 // steps, epochs=1, shuffle=False, verbose=0)
    return model.get_weights(), model


def test_reduced_gradients_are_what_the_inner_optimizer_applies():
    halved, model = train(GradientReducingOptimizer(
        keras.optimizers.SGD(0.1), reduce_fn=lambda grads: [g * 0.5 for g in grads]))
    reference, _ = train(keras.optimizers.SGD(0.05))
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(halved, reference)) < 1e-6
    assert int(model.optimizer.iterations.numpy()) == 4  # the inner optimizer's count


def test_reduce_passes_only_present_gradients_in_order():
    seen = []

    def record(grads):
        seen.append(list(grads))
        return [g + 1 for g in grads]

    optimizer = GradientReducingOptimizer(keras.optimizers.SGD(0.1), reduce_fn=record)
    first, second = tf.constant(1.0), tf.constant(2.0)
    reduced = optimizer.reduce([None, first, None, second])
    assert [float(g) for g in seen[0]] == [1.0, 2.0]
    assert reduced[0] is None and reduced[2] is None
    assert [float(reduced[1]), float(reduced[3])] == [2.0, 3.0]


def test_a_reduce_fn_that_loses_gradients_is_an_error():
    optimizer = GradientReducingOptimizer(keras.optimizers.SGD(0.1), reduce_fn=lambda g: g[:1])
    with pytest.raises(ValueError, match="returned 1 gradients for 2"):
        optimizer.reduce([tf.constant(1.0), tf.constant(2.0)])


def test_the_wrapper_is_the_inner_optimizer_to_schedules_and_config():
    inner = keras.optimizers.Adam(0.01)
    optimizer = GradientReducingOptimizer(inner, reduce_fn=lambda g: g)
    assert optimizer.iterations is inner.iterations
    optimizer.learning_rate = 0.5
    assert float(inner.learning_rate.numpy()) == 0.5
    assert optimizer.get_config() == inner.get_config()
    # A config saved by an earlier tfdist ({"inner_optimizer", "name"}) still loads.
    restored = GradientReducingOptimizer.from_config(
        {"name": "old", "inner_optimizer": keras.saving.serialize_keras_object(inner)})
    assert isinstance(restored.inner_optimizer, keras.optimizers.Adam)
    assert restored.inner_optimizer.get_config()["learning_rate"] == 0.5
    with pytest.raises(ValueError, match="must be given one again"):
        restored.reduce([tf.constant(1.0)])
    with pytest.raises(ValueError, match="set them on the inner optimizer"):
        GradientReducingOptimizer(inner, reduce_fn=lambda g: g, clipnorm=1.0)


@keras.saving.register_keras_serializable(package="users")
class UsersSGD(keras.optimizers.SGD):
    """An optimizer class of a user's own, registered as `users>UsersSGD`."""


@pytest.mark.parametrize("make", [
    lambda inner: GradientReducingOptimizer(inner, reduce_fn=lambda g: g),
    lambda inner: AccumulatingOptimizer(GradientReducingOptimizer(inner, lambda g: g), steps=2),
    lambda inner: AgreeingLossScaleOptimizer(AccumulatingOptimizer(inner, steps=2)),
], ids=["reducing", "accumulating", "loss_scale"])
@pytest.mark.parametrize("user", [lambda: keras.optimizers.Adam(0.01), lambda: UsersSGD(0.3)],
                         ids=["adam", "users_own"])
def test_each_wrapper_is_saved_as_the_users_optimizer_and_loads_as_it(make, user):
    inner = user()
    wrapped = make(inner)
    saved = keras.saving.serialize_keras_object(wrapped)
    loss_scaled = isinstance(wrapped, keras.optimizers.LossScaleOptimizer)
    if loss_scaled:
        assert saved["class_name"] == "LossScaleOptimizer"
        saved_inner = saved["config"]["inner_optimizer"]
    else:
        saved_inner = saved
    assert saved_inner["class_name"] == type(inner).__name__
    assert saved_inner["registered_name"] == keras.saving.get_registered_name(type(inner))
    assert saved_inner["config"] == inner.get_config()
    # Keras's LossScaleOptimizer.from_config pops from the config it is given: a copy each.
    loaded = keras.saving.deserialize_keras_object(copy.deepcopy(saved))
    loaded_inner = loaded.inner_optimizer if loss_scaled else loaded
    assert type(loaded_inner) is type(inner)  # the user's class, not tfdist's
    assert type(loaded) is (keras.optimizers.LossScaleOptimizer if loss_scaled else type(inner))
    # The state written is the user's optimizer's, in its layout, once.
    variables = [keras.Variable(np.ones((3,), "float32")),
                 keras.Variable(np.ones((2,), "float32"))]
    wrapped.build(variables)
    plain = keras.saving.deserialize_keras_object(copy.deepcopy(saved))
    plain.build(variables)
    store = {}
    wrapped.save_own_variables(store)
    assert len(store) == len(plain.variables)
    assert "inner_optimizer" not in dir(wrapped) or loss_scaled


def test_loss_scaling_skips_every_step_the_reduction_calls_non_finite():
    # A reduction that reports "not finite somewhere else" skips steps whose own
    # gradients are finite: nothing changes but the loss scale, halved each time.
    trained, _ = train(keras.optimizers.SGD(0.1))
    keras.utils.set_random_seed(3)
    initial = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)]).get_weights()
    optimizer = AgreeingLossScaleOptimizer(keras.optimizers.SGD(0.1),
                                           finite_reduce_fn=lambda finite: tf.constant(False))
    skipped, model = train(optimizer)
    assert all(np.array_equal(a, b) for a, b in zip(skipped, initial))
    assert int(model.optimizer.iterations.numpy()) == 0
    assert float(model.optimizer.dynamic_scale.numpy()) == 2.0 ** 15 / 2 ** 4
    assert not all(np.array_equal(a, b) for a, b in zip(trained, initial))  # steps do move it


def test_without_a_reduction_it_is_keras_loss_scaling():
    ours, _ = train(AgreeingLossScaleOptimizer(keras.optimizers.SGD(0.1)))
    keras_own, _ = train(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1)))
    assert all(np.array_equal(a, b) for a, b in zip(ours, keras_own))


def test_runner_scales_the_loss_outermost_and_keeps_a_users_settings():
    runner = tfdist.Runner(tfdist.load_config(overrides={"strategy": "one_device",
                                                         "precision": "mixed_float16"}))
    optimizer = runner.optimizer(keras.optimizers.SGD(0.1))
    assert isinstance(optimizer, AgreeingLossScaleOptimizer)
    assert isinstance(optimizer.inner_optimizer, keras.optimizers.SGD)
    users = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=8.0,
                                                dynamic_growth_steps=10)
    float32 = tfdist.Runner(tfdist.load_config(overrides={"strategy": "one_device"}))
    kept = float32.optimizer(users)
    assert isinstance(kept, AgreeingLossScaleOptimizer)
    assert (kept.initial_scale, kept.dynamic_growth_steps) == (8.0, 10)


@pytest.mark.parametrize("step, rate", [(0, 0.1), (50, 0.45), (100, 0.8), (1000, 0.8)])
def test_scaled_warmup_rises_linearly_to_the_scaled_rate(step, rate):
    schedule = ScaledWarmup(0.1, multiplier=8, warmup_steps=100)
    assert float(schedule(step)) == pytest.approx(rate, rel=1e-6)


def test_scaled_warmup_scales_a_schedule_and_survives_serialisation():
    base = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=10, decay_rate=0.5)
    schedule = ScaledWarmup(base, multiplier=4)
    assert float(schedule(10)) == pytest.approx(0.2, rel=1e-6)  # 0.05 * 4
    restored = keras.optimizers.schedules.deserialize(
        keras.optimizers.schedules.serialize(schedule))
    assert isinstance(restored, ScaledWarmup)
    assert float(restored(10)) == pytest.approx(0.2, rel=1e-6)


def test_scaled_warmup_drives_the_optimizer_step_by_step():
    optimizer = keras.optimizers.SGD(0.1)
    optimizer.learning_rate = ScaledWarmup(0.1, multiplier=2, warmup_steps=4)
    rates = []
    variable = keras.Variable(1.0)
    for _ in range(5):
        rates.append(float(optimizer.learning_rate))
        optimizer.apply([tf.constant(0.0)], [variable])
    assert rates == pytest.approx([0.1, 0.125, 0.15, 0.175, 0.2])


@pytest.mark.parametrize("kwargs, message", [
    ({"multiplier": 0}, "multiplier must be > 0"),
    ({"multiplier": 2, "warmup_steps": -1}, "warmup_steps must be >= 0")])
def test_scaled_warmup_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ScaledWarmup(0.1, **kwargs)
