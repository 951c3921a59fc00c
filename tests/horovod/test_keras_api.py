"""tfdist.horovod.keras in one process (Horovod initialised with 1 rank): the names, the
optimizer's class, config and saving, and every refusal as one line."""

import inspect
import sys
import types

import keras
import numpy as np
import pytest

from tests import reference
from tests.conftest import REPO, run_command

pytestmark = pytest.mark.requires_horovod

# Names in Horovod's modules that are the imports of other libraries, not Horovod's API.
OTHER_LIBRARIES = {"K", "keras", "tf", "inspect", "version", "warnings"}


@pytest.fixture(scope="module")
def hvd():
    import tfdist.horovod.keras as hvd

    hvd.init()
    return hvd


def public_names(module):
    return {name for name, value in vars(module).items()
            if not name.startswith("_") and name not in OTHER_LIBRARIES
            and not (isinstance(value, types.ModuleType)
                     and not value.__name__.startswith("horovod"))}


@pytest.mark.parametrize("horovod_module", ["horovod.tensorflow.keras", "horovod.keras"])
def test_every_public_name_of_horovods_keras_modules_is_here(horovod_module, hvd):
    import importlib

    theirs = importlib.import_module(horovod_module)
    assert public_names(theirs) - set(dir(hvd)) == set()
    for submodule in ("callbacks", "elastic"):
        assert public_names(getattr(theirs, submodule)) - set(dir(getattr(hvd, submodule))) \
            == set(), submodule


@pytest.mark.parametrize("name", ["DistributedOptimizer", "allreduce", "allgather", "broadcast",
                                  "reducescatter", "load_model", "PartialDistributedOptimizer"])
def test_signatures_take_horovods_arguments(name, hvd):
    import horovod.keras
    import horovod.tensorflow.keras

    ours = inspect.signature(getattr(hvd, name)).parameters
    for theirs in (horovod.tensorflow.keras, horovod.keras):
        if hasattr(theirs, name):
            assert list(inspect.signature(getattr(theirs, name)).parameters) == [
                parameter for parameter in ours if parameter in
                inspect.signature(getattr(theirs, name)).parameters], theirs


def test_the_optimizer_is_the_users_class_and_saves_as_it(hvd, tmp_path):
    users = keras.optimizers.Adam(0.01)
    optimizer = hvd.DistributedOptimizer(users)
    assert isinstance(optimizer, keras.optimizers.Adam)
    assert type(optimizer).__name__ == "Adam"
    config = optimizer.get_config()
    assert config == users.get_config()
    assert optimizer.from_config(config).get_config() == config
    assert type(optimizer).from_config(config).get_config() == config

    model = reference.make_model()
    model.compile(optimizer, "sparse_categorical_crossentropy")
    features, labels = reference.examples(64)
    model.fit(features, labels, batch_size=16, verbose=0)
    model.save(tmp_path / "model.keras")

    plain = keras.models.load_model(tmp_path / "model.keras")  # no Horovod in the file
    assert type(plain.optimizer) is keras.optimizers.Adam
    assert int(plain.optimizer.iterations.numpy()) == 4

    loaded = hvd.load_model(tmp_path / "model.keras")
    assert isinstance(loaded.optimizer, keras.optimizers.Adam)
    assert hasattr(loaded.optimizer, "register_local_var")
    for mine, theirs in zip(loaded.optimizer.variables, model.optimizer.variables):
        np.testing.assert_array_equal(mine.numpy(), theirs.numpy())
    loaded.fit(features, labels, batch_size=16, verbose=0)
    assert int(loaded.optimizer.iterations.numpy()) == 8


def test_accumulators_are_not_part_of_the_saved_optimizer(hvd):
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=4)
    model = reference.make_model()
    model.compile(optimizer, "sparse_categorical_crossentropy")
    features, labels = reference.examples(64)
    model.fit(features, labels, batch_size=8, verbose=0)  # 8 micro-batches: 2 updates
    assert int(optimizer.iterations.numpy()) == 2
    assert len(optimizer.variables) == len(keras.optimizers.SGD(0.1).variables) == 2


def test_mixed_float16_puts_the_loss_scaling_inside(hvd):
    keras.config.set_dtype_policy("mixed_float16")
    try:
        optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1))
    finally:
        keras.config.set_dtype_policy("float32")
    assert isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
    assert hasattr(optimizer, "register_local_var")


def test_sync_batch_normalization_is_keras_synchronized_layer(hvd):
    layer = hvd.SyncBatchNormalization(momentum=0.9)
    assert isinstance(layer, keras.layers.BatchNormalization) and layer.synchronized
    assert layer.name.startswith("sync_batch_normalization")


@pytest.mark.multiprocess
def test_init_applies_the_horovod_fixes_and_import_does_not(hvd):
    script = ("import tfdist.horovod.keras as hvd; from tfdist import patches; "
              "before = patches.active(); hvd.init(); print(before, len(patches.active()))")
    result = run_command([sys.executable, "-c", script], cwd=REPO)
    assert result.returncode == 0, result.stderr[-2000:]
    from tfdist import patches

    assert result.stdout.split()[-2:] == ["[]", str(len(patches.HOROVOD_KERAS))]


def test_horovods_compile_keyword_is_accepted_after_init_and_keras_refuses_it_without(hvd):
    from tfdist import patches

    model = reference.make_model()
    patches.apply(patches.HOROVOD_KERAS)
    model.compile(hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), "mse",
                  experimental_run_tf_function=False)
    patches.undo([patches.keras_trainer.HOROVOD_COMPILE_KEYWORD])
    try:
        with pytest.raises(TypeError, match="experimental_run_tf_function"):
            model.compile("sgd", "mse", experimental_run_tf_function=False)
    finally:
        patches.apply(patches.HOROVOD_KERAS)


def test_compute_gradients_returns_the_gradients_and_apply_does_not_reduce_them_again(hvd):
    import tensorflow as tf

    variable = keras.Variable([1.0, 2.0])
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), op=hvd.Sum)
    pairs = optimizer._compute_gradients(lambda: tf.reduce_sum(variable.value * 3.0),
                                         [variable])
    np.testing.assert_allclose(pairs[0][0], [3.0, 3.0])
    assert pairs[0][1] is variable and optimizer._hvd_reduction.reduced_ahead
    optimizer.apply_gradients(pairs)
    assert optimizer._hvd_reduction.reduced_ahead == []
    np.testing.assert_allclose(variable.numpy(), [-2.0, -1.0])
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(variable.value ** 2)
    [(gradient, _)] = optimizer.compute_gradients(loss, [variable], tape=tape)
    np.testing.assert_allclose(gradient, [-4.0, -2.0])
    from tfdist import ConfigError

    with pytest.raises(ConfigError, match="inside a tf.function only"):
        optimizer.get_gradients(loss, [variable])
    in_graph = tf.function(lambda: optimizer.get_gradients(
        tf.reduce_sum(variable.value * 5.0), [variable]))()
    np.testing.assert_allclose(in_graph[0], [5.0, 5.0])


def test_keras_variables_in_horovods_own_ops_work_after_init(hvd):
    import horovod.tensorflow as hvd_tf
    import tensorflow as tf

    from tfdist import patches

    patches.apply(patches.HOROVOD)
    model = reference.make_model()
    hvd_tf.broadcast_variables(model.variables, root_rank=0)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(np.ones((2, reference.FEATURES), "float32")))
    tape = hvd_tf.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)
    assert [g.shape for g in grads] == [v.shape for v in model.trainable_variables]


@pytest.mark.parametrize("call, message", [
    (lambda hvd: hvd.DistributedOptimizer("adam"), "wraps a Keras 3 optimizer"),
    (lambda hvd: hvd.DistributedOptimizer(keras.optimizers.SGD(), op="max"), "op Average, Sum"),
    (lambda hvd: hvd.DistributedOptimizer(keras.optimizers.SGD(), backward_passes_per_step=0),
     "backward_passes_per_step must be an integer >= 1"),
    (lambda hvd: hvd.DistributedOptimizer(keras.optimizers.SGD(), groups=-1),
     "groups must be a positive integer"),
    (lambda hvd: hvd.PartialDistributedOptimizer(keras.optimizers.SGD(), local_layers=[1]),
     "local_layers must be Keras layers"),
    (lambda hvd: hvd.broadcast_global_variables(0), r"BroadcastGlobalVariablesCallback\(0\)"),
    (lambda hvd: hvd.load_model("m.keras", legacy_opts=True), "Keras 3 does not have"),
    (lambda hvd: hvd.SyncBatchNormalization(fused=True), "does not support fused"),
    (lambda hvd: hvd.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=[1]),
     "local_variables must be variables"),
    (lambda hvd: hvd.callbacks.LearningRateScheduleCallback(None, 0.1), "initial_lr is required"),
    (lambda hvd: hvd.elastic.KerasState(keras.Sequential([keras.layers.Dense(2)])),
     "needs a built model"),
])
def test_what_cannot_work_is_refused_in_one_line(call, message, hvd):
    from tfdist import ConfigError

    with pytest.raises(ConfigError, match=message) as raised:
        call(hvd)
    assert "\n" not in str(raised.value)


SCHEDULE = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=10, decay_rate=0.5)


@pytest.mark.parametrize("callback, optimizer, message", [
    (lambda hvd: hvd.callbacks.LearningRateWarmupCallback(0.1, warmup_epochs=2),
     lambda: keras.optimizers.SGD(0.1, momentum=0.9), "momentum correction cannot work on Keras 3"),
    (lambda hvd: hvd.callbacks.BestModelCheckpoint(),
     lambda: keras.optimizers.SGD(0.1, momentum=0.9), "BestModelCheckpoint has no filepath"),
    (lambda hvd: hvd.callbacks.LearningRateScheduleCallback(0.1, 0.5, momentum_correction=False),
     lambda: keras.optimizers.SGD(SCHEDULE),
     "LearningRateScheduleCallback sets the learning rate, but this optimizer follows a "
     "schedule"),
    # A dataset of unknown length: fit cannot tell the callback its steps per epoch.
    (lambda hvd: hvd.callbacks.LearningRateScheduleCallback(0.1, 0.5, staircase=False,
                                                            momentum_correction=False),
     lambda: keras.optimizers.SGD(0.1),
     "LearningRateScheduleCallback could not tell the number of steps per epoch"),
])
def test_callbacks_refuse_at_fit_in_one_line(callback, optimizer, message, hvd):
    import tensorflow as tf

    from tfdist import ConfigError

    model = reference.make_model()
    model.compile(hvd.DistributedOptimizer(optimizer()), "sparse_categorical_crossentropy")
    features, labels = reference.examples(32)
    unknown_length = tf.data.Dataset.from_tensor_slices((features, labels)).filter(
        lambda *example: True).batch(16)
    with pytest.raises(ConfigError, match=message) as raised:
        model.fit(unknown_length, verbose=0, callbacks=[callback(hvd)])
    assert "\n" not in str(raised.value)


def test_warmup_without_momentum_correction_raises_the_rate_to_initial_lr(hvd):
    model = reference.make_model()
    model.compile(hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)),
                  "sparse_categorical_crossentropy")
    features, labels = reference.examples(64)
    history = model.fit(features, labels, batch_size=16, epochs=3, verbose=0, callbacks=[
        hvd.callbacks.LearningRateWarmupCallback(0.1, warmup_epochs=2, momentum_correction=False)])
    # With 1 rank the warm-up starts at initial_lr / 1: the rate stays 0.1.
    np.testing.assert_allclose(history.history["lr"], [0.1, 0.1, 0.1], rtol=1e-6)


def test_best_model_checkpoint_keeps_the_best(hvd, tmp_path):
    model = reference.make_model()
    model.compile(hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                  "sparse_categorical_crossentropy")
    features, labels = reference.examples(64)
    checkpoint = hvd.callbacks.BestModelCheckpoint(monitor="loss")
    checkpoint.filepath = str(tmp_path / "best.keras")  # as Horovod's estimators set it
    model.fit(features, labels, batch_size=16, epochs=2, verbose=0, callbacks=[checkpoint])
    assert keras.models.load_model(tmp_path / "best.keras").count_params() == model.count_params()
