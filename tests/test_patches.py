"""tfdist.patches: every fix found in the installed code, applied once, undone exactly, and
acting only where its bug applies.

That each fix is needed is shown with real clusters in tests/adapters/ (each has a test
that undoes it and watches the bare stack fail).
"""

import inspect
import sys
import threading

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfdist import patches
from tfdist.patches import keras_trainer, keras_variables, tensorflow_backprop
from tests.conftest import run_command

ALL = patches.registered()
PERSISTENT = [patch for patch in ALL
              if patch.name not in ("tensorflow.distribute.mirrored_collective_keys",
                                    "tensorflow.distribute.multi_worker_cpu_replicas")]


@pytest.fixture(autouse=True)
def stack_as_installed():
    patches.undo_all()
    yield
    patches.undo_all()


def _state(patch):
    owner = patch._owner()
    return inspect.getattr_static(owner, patch.attribute), patch.attribute in vars(owner)


def test_every_patch_names_its_upstream_issue_and_what_breaks():
    names = [patch.name for patch in ALL]
    assert len(names) == len(set(names)) == 30
    for patch in ALL:
        assert patch.upstream and patch.summary, patch
        assert patch.name.split(".")[0] in ("keras", "tensorflow", "horovod"), patch


@pytest.mark.parametrize("patch", ALL, ids=lambda patch: patch.name)
def test_the_check_still_finds_the_bug_in_the_installed_code(patch):
    # A release that fixes a bug changes the lines its check reads: then this fails,
    # and the patch (which would stay off) can be retired.
    assert patch.bug_present(), f"{patch.name}: {patch.upstream} looks fixed in this release"


@pytest.mark.parametrize("patch", ALL, ids=lambda patch: patch.name)
def test_apply_is_idempotent_and_undo_puts_back_the_original(patch):
    before = _state(patch)
    parameters = {"replicas": 2} if patch.attribute == "_initialize_local_devices" else {}
    assert patch.apply(**parameters) and patch.active
    assert patch.name in patches.active()
    assert _state(patch)[0] is not before[0]
    assert not patch.apply(**parameters)  # once only
    assert patch.undo() and not patch.active
    assert _state(patch) == before  # the same object, owned (or inherited) as before
    assert not patch.undo()


def test_applying_from_many_threads_applies_once():
    patch = keras_trainer.MULTI_WORKER_METRIC_REDUCTION
    results, start = [], threading.Barrier(8)

    def apply():
        start.wait()
        results.append(patch.apply())

    threads = [threading.Thread(target=apply) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(results) == [False] * 7 + [True]


def test_undo_refuses_to_throw_away_a_later_replacement():
    patch = keras_trainer.MULTI_WORKER_METRIC_REDUCTION
    patch.apply()
    module = patch._owner()
    theirs = lambda values, strategy, reduction: values  # noqa: E731
    module.reduce_per_replica = theirs
    try:
        with pytest.raises(RuntimeError, match="replaced again"):
            patch.undo()
    finally:
        module.reduce_per_replica = inspect.getattr_static(patch, "_applied")[3]
    assert patch.undo()


def test_a_temporary_patch_is_gone_after_its_block():
    from tfdist.patches import tensorflow_distribute

    patch = tensorflow_distribute.MIRRORED_COLLECTIVE_KEYS
    with patch.applied() as in_place:
        assert in_place and tf.distribute.MirroredStrategy._collective_key_base > 0
    assert tf.distribute.MirroredStrategy._collective_key_base == 0
    assert not patch.active


def test_group_helpers_apply_and_undo_by_strategy():
    assert patches.apply(patches.MULTI_WORKER) == [p.name for p in patches.MULTI_WORKER]
    assert patches.apply(patches.MULTI_WORKER) == []
    assert sorted(patches.active()) == sorted(p.name for p in patches.MULTI_WORKER)
    assert sorted(patches.undo_all()) == sorted(p.name for p in patches.MULTI_WORKER)
    assert patches.active() == []
    with pytest.raises(KeyError, match="known: "):
        patches.by_name("keras.nothing")


@pytest.mark.parametrize("first", ["horovod_keras", "multi_worker"])
def test_two_patches_of_one_attribute_undo_in_either_order_they_were_applied(first):
    # Keras's _maybe_symbolic_build has a patch in HOROVOD_KERAS and one in MULTI_WORKER:
    # undoing them by definition order failed whenever the later-defined one went in first.
    groups = {"horovod_keras": patches.HOROVOD_KERAS, "multi_worker": patches.MULTI_WORKER}
    second = "multi_worker" if first == "horovod_keras" else "horovod_keras"
    installed = _state(keras_trainer.MULTI_WORKER_SYMBOLIC_BUILD)
    patches.apply(groups[first])
    patches.apply(groups[second])
    both = {keras_trainer.MULTI_WORKER_SYMBOLIC_BUILD.name,
            keras_trainer.HOROVOD_BUILD_BEFORE_CALLBACKS.name}
    assert both <= set(patches.active())
    assert both <= set(patches.undo_all())
    assert patches.active() == [] and _state(keras_trainer.MULTI_WORKER_SYMBOLIC_BUILD) == installed


@pytest.mark.multiprocess
def test_importing_tfdist_applies_nothing(tmp_path):
    code = ("import inspect, tfdist; from tfdist import patches; "
            "print(patches.active(), all(not hasattr(inspect.getattr_static(p._owner(), "
            "p.attribute), '__tfdist_patch__') for p in patches.registered()))")
    result = run_command([sys.executable, "-c", code], cwd=tmp_path)
    assert result.stdout.strip() == "[] True", result.stderr[-2000:]


class Counter(keras.layers.Layer):
    """Counts its calls in a non-trainable variable, with `assign_add`."""

    def build(self, input_shape):
        self.calls = self.add_weight(shape=(), initializer="zeros", trainable=False,
                                     name="calls")

    def call(self, inputs):
        self.calls.assign_add(1.0)
        return inputs


@pytest.mark.parametrize("patched", [False, True])
def test_atomic_updates_leave_stateless_calls_and_plain_variables_to_keras(patched):
    if patched:
        assert patches.apply([keras_variables.ATOMIC_ASSIGN_ADD,
                              keras_variables.ATOMIC_ASSIGN_SUB])
    layer = Counter()
    layer(np.ones((1, 2), "float32"))
    assert float(layer.calls.numpy()) == 1.0  # a plain variable: Keras's own update
    outputs, non_trainable = layer.stateless_call([], [v.value for v in
                                                       layer.non_trainable_variables],
                                                  np.ones((1, 2), "float32"))
    assert float(layer.calls.numpy()) == 1.0  # the real variable is untouched
    assert float(non_trainable[0].numpy()) == 2.0  # the update is returned instead
    layer.calls.assign_sub(1.0)
    assert float(layer.calls.numpy()) == 0.0


def test_tape_gradients_without_sharded_variables_are_tensorflows_own():
    variable = tf.Variable([1.0, 2.0])

    def gradients():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(variable * variable)
        return tape.gradient(loss, {"v": variable})["v"].numpy()

    expected = gradients()
    assert tensorflow_backprop.SHARDED_VARIABLE_GRADIENTS.apply()
    np.testing.assert_array_equal(gradients(), expected)


def test_routed_fit_leaves_other_models_to_keras_with_positional_arguments():
    patches.apply(patches.PARAMETER_SERVER)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    x, y = np.ones((8, 2), "float32"), np.ones((8, 1), "float32")
    history = model.fit(x, y, 4, 2, 0)  # batch_size=4, epochs=2, verbose=0
    assert len(history.history["loss"]) == 2
    assert model.evaluate(x, y, 8, 0) == pytest.approx(history.history["loss"][-1], rel=0.5)
    with pytest.raises(TypeError):
        model.fit(x, y, not_a_keras_argument=1)


def test_the_parameter_server_loop_refuses_a_keyword_it_does_not_know():
    from tfdist.adapters.parameter_server import coordinated_fit
    from tfdist.errors import ConfigError

    with pytest.raises(ConfigError, match="does not take keyword_from_a_newer_keras"):
        coordinated_fit.fit(None, None, keyword_from_a_newer_keras=True)
