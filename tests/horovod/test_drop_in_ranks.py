"""tfdist.horovod.keras on 2 real ranks (mpirun and horovodrun --gloo), against one device.

The script is a classic Horovod Keras script (tests/scripts/horovod_keras_script.py);
only its import line differs between tfdist's drop-in and Horovod's own module.
"""

import json
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests import reference
from tests.conftest import REPO, launcher_command, run_command

SCRIPT = str(REPO / "tests" / "scripts" / "horovod_keras_script.py")
sys.path.insert(0, str(REPO / "tests" / "scripts"))
import horovod_keras_script as job  # noqa: E402

# One pytest-xdist worker runs this module, so the `variants` launch is made once.
pytestmark = [pytest.mark.requires_mpi, pytest.mark.requires_horovod, pytest.mark.multiprocess,
              pytest.mark.xdist_group("horovod_drop_in")]


def run_script(tmp_path, *args, launcher="mpirun"):
    """Runs the script on 2 ranks; returns (report by rank, weights by rank)."""
    result = run_command(launcher_command(launcher, sys.executable, SCRIPT, str(tmp_path), *args),
                         cwd=tmp_path, timeout=120)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    return outcome(tmp_path)


# The tfdist drop-in's runs under mpirun that succeed: one launch runs them all in turn
# (`--variants`), each as if launched alone, since 2 ranks starting TensorFlow and Horovod
# cost more CPU than these runs do. Horovod's own module and horovodrun run alone.
VARIANTS = {
    "sgd": ["--optimizer=sgd"],
    "adam": ["--optimizer=adam"],
    "as_horovod_docs": ["--optimizer=adam", "--as_horovod_docs"],
    "backward_passes_averaged": ["--optimizer=adam", "--backward_passes=4",
                                 "--average_aggregated"],
    "backward_passes_summed": ["--optimizer=sgd", "--backward_passes=4"],
    "mixed_float16_inf": ["--mixed_float16_inf_at=3"],
    "groups=2": ["--optimizer=adam", "--option=groups=2"],
    "groups=by_layer": ["--optimizer=adam", "--option=groups=by_layer"],
    "gradient_predivide_factor=2.0": ["--optimizer=adam",
                                      "--option=gradient_predivide_factor=2.0"],
    "op=Sum": ["--optimizer=sgd", "--option=op=Sum"],
    "op=Adasum": ["--optimizer=sgd", "--option=op=Adasum"],
    "compression=fp16": ["--optimizer=sgd", "--option=compression=fp16"],
}


@pytest.fixture(scope="module")
def variants(tmp_path_factory):
    """variants(name): (report by rank, weights by rank) of that run of VARIANTS."""
    out = tmp_path_factory.mktemp("drop_in_variants")
    result = run_command(launcher_command("mpirun", sys.executable, SCRIPT, str(out),
                                          "--variants", json.dumps(VARIANTS)),
                         cwd=out, timeout=300)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    return lambda name: outcome(out / name)


def run_of(launcher, name, tmp_path, variants):
    """A variant's outcome: from the shared launch under mpirun, from its own otherwise."""
    if launcher == "mpirun":
        return variants(name)
    return run_script(tmp_path, *VARIANTS[name], launcher=launcher)


def outcome(out_dir):
    """(report by rank, weights by rank) from the files a run's ranks wrote."""
    reports = {rank: json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in (0, 1)}
    weights = {rank: [array for _, array in sorted(
        np.load(out_dir / f"rank{rank}.npz").items(), key=lambda item: int(item[0][2:]))]
        for rank in (0, 1)}
    return reports, weights


def one_device(optimizer, batch=job.GLOBAL_BATCH, passes=1, learning_rate_scale=1.0):
    """Rank 0's start trained on one device with `batch`-example batches."""
    keras.backend.clear_session()
    model = reference.make_model()
    model.set_weights(reference.initial_weights(100))
    made = reference.make_optimizer(optimizer)
    made.learning_rate = float(made.learning_rate.numpy()) * learning_rate_scale
    model.compile(made, "sparse_categorical_crossentropy", metrics=["accuracy"])
    features, labels = reference.examples(job.GLOBAL_BATCH * job.STEPS * passes)
    history = model.fit(tf.data.Dataset.from_tensor_slices((features, labels)).batch(batch),
                        epochs=job.EPOCHS, verbose=0)
    return model.get_weights(), history.history


@pytest.mark.parametrize("launcher", ["mpirun", "horovodrun"])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_a_classic_horovod_script_equals_one_device(launcher, optimizer, tmp_path, variants):
    reports, weights = run_of(launcher, optimizer, tmp_path, variants)
    expected, history = one_device(optimizer)
    for rank in (0, 1):
        assert reference.largest_difference(weights[rank], expected) < reference.TOLERANCE
        # One grouped allreduce per step, and Keras's own class name.
        assert reports[rank]["allreduces"] == reports[rank]["iterations"] == job.STEPS * job.EPOCHS
        users_class = type(reference.make_optimizer(optimizer)).__name__
        assert reports[rank]["optimizer_class"] == users_class
    # MetricAverageCallback: both ranks log the mean over the global batches.
    assert reports[0]["history"] == reports[1]["history"]
    np.testing.assert_allclose(reports[0]["history"]["loss"], history["loss"], rtol=1e-4)


@pytest.mark.parametrize("launcher", ["mpirun", "horovodrun"])
def test_a_model_built_on_its_first_batch_compiled_as_horovods_docs_equals_one_device(
        launcher, tmp_path, variants):
    # No keras.Input (each rank draws its own weights when fit builds the model, before the
    # broadcast) and compile(..., experimental_run_tf_function=False), as Horovod's docs.
    reports, weights = run_of(launcher, "as_horovod_docs", tmp_path, variants)
    keras.backend.clear_session()
    keras.utils.set_random_seed(100)
    model = job.make_model_without_input()
    model.compile(reference.make_optimizer("adam"), "sparse_categorical_crossentropy")
    features, labels = reference.examples(job.GLOBAL_BATCH * job.STEPS)
    model.fit(tf.data.Dataset.from_tensor_slices((features, labels)).batch(job.GLOBAL_BATCH),
              epochs=job.EPOCHS, verbose=0)
    for rank in (0, 1):
        assert reports[rank]["iterations"] == job.STEPS * job.EPOCHS
        assert reference.largest_difference(weights[rank], model.get_weights()) < \
            reference.TOLERANCE


@pytest.mark.parametrize("op, reduced", [("Sum", 3.0), ("Average", 1.5)])
def test_a_custom_loop_with_compute_gradients_reduces_once(op, reduced, tmp_path):
    # Rank r's gradient is r + 1: summed 3, averaged 1.5. apply_gradients must not reduce
    # what _compute_gradients returned again (a second sum would step by 6).
    script = str(REPO / "tests" / "scripts" / "horovod_custom_loop.py")
    result = run_command(launcher_command("mpirun", sys.executable, script, str(tmp_path),
                                          "--op", op), cwd=tmp_path, timeout=120)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    for rank in (0, 1):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert report["gradient"] == [reduced, reduced]
        np.testing.assert_allclose(report["w"], [1.0 - 0.1 * reduced, 2.0 - 0.1 * reduced],
                                   rtol=0, atol=1e-6)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_horovods_own_keras_module_leaves_the_ranks_unequal(optimizer, tmp_path):
    # The bare stack: Horovod's DistributedOptimizer overrides methods Keras 3 never calls,
    # so nothing is reduced and each rank trains on its own half. No error is raised.
    # (Its callbacks raise on Keras 3: test_bare_horovod_keras_fails_on_keras_3.)
    reports, weights = run_script(tmp_path, f"--optimizer={optimizer}", "--same_start",
                                  "--no_callbacks", "--module=horovod.tensorflow.keras")
    assert reports[0]["allreduces"] == reports[1]["allreduces"] == 0
    assert reference.largest_difference(weights[0], weights[1]) > 1e-3
    expected, _ = one_device(optimizer)
    assert reference.largest_difference(weights[0], expected) > 1e-3


def test_backward_passes_per_step_4_averaged_equals_one_device_at_4x_the_batch(variants):
    reports, weights = variants("backward_passes_averaged")
    expected, _ = one_device("adam", batch=4 * job.GLOBAL_BATCH, passes=4)
    updates = job.STEPS * job.EPOCHS  # 4 micro-batches each
    for rank in (0, 1):
        assert reference.largest_difference(weights[rank], expected) < reference.TOLERANCE
        assert reports[rank]["allreduces"] == reports[rank]["iterations"] == updates


def test_backward_passes_per_step_4_summed_as_horovod_equals_4x_the_learning_rate(variants):
    # Horovod's default (average_aggregated_gradients=False) applies the sum of the 4.
    reports, weights = variants("backward_passes_summed")
    expected, _ = one_device("sgd", batch=4 * job.GLOBAL_BATCH, passes=4, learning_rate_scale=4.0)
    for rank in (0, 1):
        assert reference.largest_difference(weights[rank], expected) < reference.TOLERANCE
        assert reports[rank]["allreduces"] == job.STEPS * job.EPOCHS


def test_mixed_float16_inf_on_one_rank_skips_the_step_on_both(variants):
    # DistributedOptimizer puts the loss scaling inside, around the reduced gradients: both
    # ranks see the inf after the allreduce and skip the same steps (Keras's compile would
    # have put it outside, each rank checking its own gradients before the allreduce).
    reports, weights = variants("mixed_float16_inf")
    assert reports[0]["optimizer_class"] == "LossScaleOptimizer"
    assert reports[0]["iterations"] == reports[1]["iterations"] < job.STEPS * job.EPOCHS
    assert reports[0]["finite"] and reports[1]["finite"]
    assert reference.largest_difference(weights[0], weights[1]) == 0.0


@pytest.mark.parametrize("option, allreduces_per_step", [
    ("groups=2", 2), ("groups=by_layer", 2), ("gradient_predivide_factor=2.0", 1)])
def test_horovods_reduction_options_still_equal_one_device(option, allreduces_per_step,
                                                           variants):
    reports, weights = variants(option)
    expected, _ = one_device("adam")
    for rank in (0, 1):
        assert reference.largest_difference(weights[rank], expected) < reference.TOLERANCE
        assert reports[rank]["allreduces"] == allreduces_per_step * job.STEPS * job.EPOCHS


def test_op_sum_equals_one_device_at_twice_the_learning_rate(variants):
    reports, weights = variants("op=Sum")
    expected, _ = one_device("sgd", learning_rate_scale=2.0)
    for rank in (0, 1):
        assert reference.largest_difference(weights[rank], expected) < reference.TOLERANCE


@pytest.mark.parametrize("option", ["op=Adasum", "compression=fp16"])
def test_adasum_and_fp16_compression_keep_the_ranks_identical(option, variants):
    # Neither is an average of float32 gradients: the ranks agree with each other, and
    # stay near (fp16) or away from (Adasum) one device.
    reports, weights = variants(option)
    assert reference.largest_difference(weights[0], weights[1]) == 0.0
    expected, _ = one_device("sgd")
    difference = reference.largest_difference(weights[0], expected)
    if option == "compression=fp16":
        assert 0.0 < difference < 1e-2
    else:
        assert difference > reference.TOLERANCE
