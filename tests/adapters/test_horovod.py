"""horovod under Keras 3 model.fit, with 2 real ranks started by mpirun (and horovodrun)."""

import json
import os
import sys

import keras
import numpy as np
import pytest

import tfdist
from tfdist.cluster import detect_cluster
from tests.conftest import REPO, TFDIST, horovodrun, last_json_line, mpirun, run_command

# One pytest-xdist worker runs this module, so the `trained` runs are made once.
pytestmark = pytest.mark.xdist_group("adapters_horovod")


SCRIPT = str(REPO / "tests" / "scripts" / "horovod_training.py")
TOLERANCE = 1e-5
MIXED_TOLERANCE = 1e-3  # float16 rounds by ~4e-5 here; a step more or less moves 1e-2+


def reports(out_dir):
    """Each rank's report, by rank, from the file each rank wrote."""
    found = [json.loads(path.read_text()) for path in sorted(out_dir.glob("rank*.json"))]
    return {report["rank"]: report for report in found}


def weights(path):
    return [array for _, array in sorted(np.load(path).items(),
                                         key=lambda item: int(item[0].split("_")[1]))]


def ranks_of(out_dir):
    """(reports by rank, weights by rank) of one run's folder."""
    by_rank = reports(out_dir)
    assert sorted(by_rank) == [0, 1], sorted(out_dir.iterdir())
    return by_rank, {rank: weights(out_dir / f"rank{rank}.npz") for rank in (0, 1)}


# The runs of the tests below that train and succeed: one launch trains them all in turn
# (`--variants`), each as if launched alone, since 2 ranks starting TensorFlow and Horovod
# cost more CPU than these runs do.
VARIANTS = {
    "sgd": ["--optimizer=sgd", "--seed_by_rank"],
    "adam": ["--optimizer=adam", "--seed_by_rank"],
    "accumulate_sgd": ["--optimizer=sgd", "--seed_by_rank", "--set=accumulation_steps=4"],
    "accumulate_adam": ["--optimizer=adam", "--seed_by_rank", "--set=accumulation_steps=4"],
    "cycle_split": ["--set=accumulation_steps=3", "--steps=5", "--epochs=2", "--seed_by_rank",
                    "--fits=2"],
    "cycle_whole": ["--set=accumulation_steps=3", "--steps=5", "--epochs=2", "--seed_by_rank"],
    "accumulate_fp16_inf": ["--precision=mixed_float16", "--inf_at_step=3", "--epochs=1",
                            "--set=accumulation_steps=4"],
    "horovod.op=sum": ["--optimizer=sgd", "--set=horovod.op=sum"],
    "horovod.scale_learning_rate=true": ["--optimizer=sgd",
                                         "--set=horovod.scale_learning_rate=true"],
    "grouped": ["--optimizer=adam", "--seed_by_rank", "--set=horovod.grouped=true"],
    "sparse_as_dense=false": ["--embedding", "--seed_by_rank",
                              "--set=horovod.sparse_as_dense=false"],
    "sparse_as_dense=true": ["--embedding", "--seed_by_rank",
                             "--set=horovod.sparse_as_dense=true"],
    "fp16_compression": ["--set=horovod.compression=fp16"],
    "adasum": ["--set=horovod.op=adasum"],
    "seeded": ["--seed_by_rank", "--steps=1", "--epochs=1"],
    "seeded_without_broadcast": ["--seed_by_rank", "--steps=1", "--epochs=1",
                                 "--without=broadcast"],
    "fp16_inf": ["--precision=mixed_float16", "--inf_at_step=3", "--epochs=1",
                 "--optimizer=adam"],
    "fp16_inf_sgd": ["--precision=mixed_float16", "--inf_at_step=3", "--epochs=1",
                     "--optimizer=sgd"],
}


@pytest.fixture(scope="module")
def variants(tmp_path_factory):
    """variants(name): (reports by rank, weights by rank, folder) of that run of VARIANTS."""
    out = tmp_path_factory.mktemp("horovod_variants")
    result = run_command(mpirun(sys.executable, SCRIPT, str(out),
                                "--variants", json.dumps(VARIANTS)), cwd=out, timeout=300)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]

    def get(name):
        return (*ranks_of(out / name), out / name)

    return get


def training_job():
    """tests/scripts/horovod_training.py, imported: its model, data and optimizers."""
    sys.path.insert(0, str(REPO / "tests" / "scripts"))
    import horovod_training

    return horovod_training


def one_device_run(start, optimizer, steps, epochs, learning_rate=None, embedding=False,
                   precision="float32", inf_at_step=None):
    """one_device with the global batch, from the same start: (weights, history); with
    mixed_float16, also the loss scale at the end."""
    import tensorflow as tf

    job = training_job()
    keras.backend.clear_session()
    runner = tfdist.Runner(tfdist.load_config(overrides={"strategy": "one_device",
                                                         "precision": precision}))
    with runner.scope():
        model = job.make_model(embedding)
        model.set_weights(start)
        made = job.make_optimizer(optimizer)
        if learning_rate is not None:
            made.learning_rate = learning_rate
        model.compile(runner.optimizer(made), "sparse_categorical_crossentropy",
                      metrics=["accuracy"])
    data = runner.dataset(tf.data.Dataset.from_tensor_slices(
        job.examples(steps, inf_at_step, embedding=embedding)), job.GLOBAL_BATCH)
    history = model.fit(data, epochs=epochs, verbose=0)
    if precision == "mixed_float16":
        history.history["loss_scale"] = float(model.optimizer.dynamic_scale.numpy())
        history.history["iterations"] = int(model.optimizer.iterations.numpy())
    return model.get_weights(), history.history


def adasum(first, second):
    """Horovod's Adasum of two ranks' gradients of one tensor, as its CPU code computes it
    (horovod/common/ops/adasum/adasum.h: dot products in float64): each gradient less half
    its projection on the other, a gradient whose squared norm is below 1e-8 taken whole."""
    a, b = np.asarray(first, "float64"), np.asarray(second, "float64")
    dot, a_squared, b_squared = float(np.sum(a * b)), float(np.sum(a * a)), float(np.sum(b * b))
    a_coefficient = 1.0 - dot / a_squared * 0.5 if a_squared >= 1e-8 else 1.0
    b_coefficient = 1.0 - dot / b_squared * 0.5 if b_squared >= 1e-8 else 1.0
    return a_coefficient * a + b_coefficient * b


def one_device_adasum_run(start, steps, epochs):
    """SGD on one device whose every step applies the Adasum of the two halves' mean
    gradients: what 2 ranks, each on its half of the global batch, combine with Adasum."""
    import tensorflow as tf

    job = training_job()
    keras.backend.clear_session()
    model = job.make_model()
    model.set_weights(start)
    optimizer = job.make_optimizer("sgd")
    features, labels = job.examples(steps)
    loss = keras.losses.SparseCategoricalCrossentropy()
    half = job.GLOBAL_BATCH // 2
    for _ in range(epochs):
        for step in range(steps):
            halves = []
            for first in (step * job.GLOBAL_BATCH, step * job.GLOBAL_BATCH + half):
                with tf.GradientTape() as tape:
                    value = loss(labels[first:first + half],
                                 model(features[first:first + half], training=True))
                halves.append(tape.gradient(value, model.trainable_variables))
            combined = [tf.constant(adasum(a, b), tf.float32) for a, b in zip(*halves)]
            optimizer.apply_gradients(zip(combined, model.trainable_variables))
    return model.get_weights()


def max_difference(first, second):
    return max(float(np.max(np.abs(a - b))) for a, b in zip(first, second))


@pytest.fixture(scope="module", params=["sgd", "adam"])
def trained(request, variants):
    """2 ranks from different initial weights, 10 steps x 2 epochs, and one_device beside them."""
    by_rank, weights_by_rank, out = variants(request.param)
    start = weights(out / "start.npz")
    reference, reference_history = one_device_run(start, request.param, steps=10, epochs=2)
    return by_rank, weights_by_rank, start, reference, reference_history


@pytest.mark.requires_mpi
@pytest.mark.requires_horovod
@pytest.mark.multiprocess
def test_every_rank_equals_one_device(trained):
    by_rank, weights_by_rank, start, reference, _ = trained
    assert all((report["iterations"], report["reductions"]) == (20, 20)
               for report in by_rank.values())
    # Each rank's share of the cores (less one for Horovod above 2), not all of them.
    share = max(1, detect_cluster(probe_gpus=False).cpu_cores // 2)
    expected_threads = share - 1 if share > 2 else share
    assert all(report["intra_op_threads"] == expected_threads for report in by_rank.values())
    assert max_difference(reference, start) > 1e-2  # training moved the weights
    for rank in (0, 1):
        assert max_difference(weights_by_rank[rank], reference) < TOLERANCE


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.requires_mpi
@pytest.mark.requires_horovod
@pytest.mark.multiprocess
def test_accumulating_4_micro_batches_equals_one_device(optimizer, variants):
    # Micro-batches of 8 (4 per rank), 4 per update: the 20 updates of batch 32, and one
    # allreduce per update, not per micro-batch.
    by_rank, weights_by_rank, out = variants(f"accumulate_{optimizer}")
    assert all((report["iterations"], report["reductions"]) == (20, 20)
               for report in by_rank.values())
    reference, _ = one_device_run(weights(out / "start.npz"), optimizer, steps=10, epochs=2)
    for rank in (0, 1):
        assert max_difference(weights_by_rank[rank], reference) < TOLERANCE


@pytest.mark.requires_mpi
@pytest.mark.requires_horovod
@pytest.mark.multiprocess
def test_a_cycle_carried_into_the_next_fit_keeps_each_ranks_accumulators(variants):
    # 16 micro-batches of 10 per epoch, 3 per update: the first fit ends 1 micro-batch into
    # a cycle. The broadcast at the second fit's start must leave each rank's partial sums.
    _, split, _ = variants("cycle_split")
    _, whole, _ = variants("cycle_whole")
    for rank in (0, 1):
        assert max_difference(split[rank], whole[rank]) < TOLERANCE


@pytest.mark.requires_mpi
@pytest.mark.requires_horovod
@pytest.mark.multiprocess
def test_accumulation_under_mixed_float16_skips_the_cycle_with_an_inf_on_both_ranks(variants):
    by_rank, weights_by_rank, _ = variants("accumulate_fp16_inf")
    # 10 cycles of 4 micro-batches; the inf is in cycle 3 on rank 1: 9 updates on both.
    assert [(by_rank[r]["iterations"], by_rank[r]["reductions"]) for r in (0, 1)] == [(9, 9)] * 2
    assert [by_rank[rank]["loss_scale"] for rank in (0, 1)] == [2.0 ** 14] * 2
    assert max_difference(weights_by_rank[0], weights_by_rank[1]) == 0.0


@pytest.mark.requires_mpi
@pytest.mark.requires_horovod
@pytest.mark.multiprocess
def test_history_is_the_same_on_every_rank_and_is_the_global_mean(trained):
    by_rank, _, _, _, reference_history = trained
    history, other = by_rank[0]["history"], by_rank[1]["history"]
    assert history == other
    local = [by_rank[rank]["local_history"] for rank in (0, 1)]
    assert local[0]["loss"] != local[1]["loss"]  # each rank saw other examples
    for key in ("loss", "accuracy"):
        assert np.allclose(history[key], np.mean([local[0][key], local[1][key]], axis=0),
                           rtol=0, atol=1e-7)
        assert np.allclose(history[key], reference_history[key], rtol=0, atol=TOLERANCE)


@pytest.mark.parametrize("setting", ["horovod.op=sum", "horovod.scale_learning_rate=true"])
@pytest.mark.requires_mpi
@pytest.mark.requires_horovod
@pytest.mark.multiprocess
def test_summed_gradients_or_a_scaled_rate_equal_one_device_at_twice_the_rate(setting,
                                                                              variants):
    # With SGD, the sum of 2 ranks' mean gradients, or their mean at twice the rate, is
    # one_device's step at twice the rate.
    by_rank, weights_by_rank, out = variants(setting)
    reference, _ = one_device_run(weights(out / "start.npz"), "sgd", steps=10, epochs=2,
                                  learning_rate=0.2)
    for rank in (0, 1):
        assert max_difference(weights_by_rank[rank], reference) < TOLERANCE


# Two host names for this machine: horovodrun --gloo starts a rank on each, so each rank
# is local rank 0 of 1 on its host, and global rank 0 or 1 of 2, as on two machines.
TWO_HOSTS = "localhost:1,127.0.0.1:1"
ON_TWO_HOSTS = {
    "sgd": ["--optimizer=sgd"],
    "horovod.scale_learning_rate=true": ["--optimizer=sgd",
                                         "--set=horovod.scale_learning_rate=true"],
}


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory):
    """two_hosts(name): (reports by rank, weights by rank, folder) of that run of
    ON_TWO_HOSTS, trained with one rank on each of two hosts."""
    out = tmp_path_factory.mktemp("horovod_two_hosts")
    result = run_command(horovodrun(sys.executable, SCRIPT, str(out), "--variants",
                                    json.dumps(ON_TWO_HOSTS), hosts=TWO_HOSTS),
                         cwd=out, timeout=300)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    return lambda name: (*ranks_of(out / name), out / name)


@pytest.mark.parametrize("name, learning_rate", [("sgd", 0.1),
                                                 ("horovod.scale_learning_rate=true", 0.2)])
@pytest.mark.requires_horovod
@pytest.mark.multiprocess
def test_ranks_on_two_hosts_slice_and_scale_by_the_global_rank_and_size(name, learning_rate,
                                                                        two_hosts):
    # Each rank takes its global rank's slice of every batch (local rank 0 on both hosts
    # would train both on the first half), and the rate scales by the global size (the
    # local size, 1, would leave it at 0.1).
    by_rank, weights_by_rank, out = two_hosts(name)
    assert [(by_rank[r]["size"], by_rank[r]["local_rank"], by_rank[r]["local_size"])
            for r in (0, 1)] == [(2, 0, 1)] * 2
    reference, _ = one_device_run(weights(out / "start.npz"), "sgd", steps=10, epochs=2,
                                  learning_rate=learning_rate)
    for rank in (0, 1):
        assert max_difference(weights_by_rank[rank], reference) < TOLERANCE


@pytest.mark.requires_mpi
@pytest.mark.requires_horovod
@pytest.mark.multiprocess
def test_one_grouped_allreduce_equals_one_device(variants):
    # horovod.grouped=true: all gradients in one grouped_allreduce (the default is one
    # allreduce per gradient, which every other test here runs).
    by_rank, weights_by_rank, out = variants("grouped")
    reference, _ = one_device_run(weights(out / "start.npz"), "adam", steps=10, epochs=2)
    for rank in (0, 1):
        assert max_difference(weights_by_rank[rank], reference) < TOLERANCE


@pytest.mark.parametrize("as_dense", ["false", "true"])
@pytest.mark.requires_mpi
@pytest.mark.requires_horovod
@pytest.mark.multiprocess
def test_sparse_embedding_gradients_equal_one_device(as_dense, variants):
    # Embedding gradients are tf.IndexedSlices: allgathered, or allreduced as dense.
    by_rank, weights_by_rank, out = variants(f"sparse_as_dense={as_dense}")
    reference, _ = one_device_run(weights(out / "start.npz"), "sgd", steps=10, epochs=2,
                                  embedding=True)
    for rank in (0, 1):
        assert max_difference(weights_by_rank[rank], reference) < TOLERANCE


@pytest.mark.requires_mpi
@pytest.mark.requires_horovod
@pytest.mark.multiprocess
def test_fp16_compression_is_close_to_one_device_but_rounded(variants):
    by_rank, weights_by_rank, out = variants("fp16_compression")
    assert max_difference(weights_by_rank[0], weights_by_rank[1]) == 0.0
    reference, _ = one_device_run(weights(out / "start.npz"), "sgd", steps=10, epochs=2)
    assert 1e-7 < max_difference(weights_by_rank[0], reference) < 1e-2


@pytest.mark.requires_mpi
@pytest.mark.requires_horovod
@pytest.mark.multiprocess
def test_adasum_equals_one_device_combining_the_halves_gradients_by_adasum(variants):
    by_rank, weights_by_rank, out = variants("adasum")
    assert [by_rank[rank]["iterations"] for rank in (0, 1)] == [20, 20]
    start = weights(out / "start.npz")
    expected = one_device_adasum_run(start, steps=10, epochs=2)
    for rank in (0, 1):
        assert max_difference(weights_by_rank[rank], expected) < TOLERANCE
    # Neither the halves' average (one device's own step) nor their sum.
    averaged, _ = one_device_run(start, "sgd", steps=10, epochs=2)
    summed, _ = one_device_run(start, "sgd", steps=10, epochs=2, learning_rate=0.2)
    assert max_difference(expected, averaged) > 1e-3 and max_difference(expected, summed) > 1e-3


@pytest.mark.parametrize("name, identical", [("seeded", True),
                                             ("seeded_without_broadcast", False)])
@pytest.mark.requires_mpi
@pytest.mark.requires_horovod
@pytest.mark.multiprocess
def test_ranks_seeded_differently_are_identical_after_the_first_step(name, identical,
                                                                     variants):
    by_rank, weights_by_rank, out = variants(name)
    assert [by_rank[rank]["iterations"] for rank in (0, 1)] == [1, 1]
    apart = max_difference(weights_by_rank[0], weights_by_rank[1])
    if identical:
        assert apart == 0.0
        reference, _ = one_device_run(weights(out / "start.npz"), "sgd", steps=1, epochs=1)
        assert max_difference(weights_by_rank[0], reference) < TOLERANCE
    else:
        assert apart > 1e-2  # without the broadcast the ranks keep their own weights


@pytest.mark.parametrize("name, optimizer", [("fp16_inf", "adam"), ("fp16_inf_sgd", "sgd")])
@pytest.mark.requires_mpi
@pytest.mark.requires_horovod
@pytest.mark.multiprocess
def test_mixed_float16_inf_on_one_rank_skips_the_step_on_both_as_one_device(
        name, optimizer, variants):
    by_rank, weights_by_rank, out = variants(name)
    # 10 steps, one skipped everywhere: 9 updates, and the loss scale halved once.
    assert [by_rank[rank]["iterations"] for rank in (0, 1)] == [9, 9]
    assert [by_rank[rank]["loss_scale"] for rank in (0, 1)] == [2.0 ** 14] * 2
    assert max_difference(weights_by_rank[0], weights_by_rank[1]) == 0.0
    assert all(np.all(np.isfinite(array)) for array in weights_by_rank[0])
    # One device with the inf in its global batch skips the same step. float16 sums of 16
    # and of 32 examples round apart, hence the tolerance; a step more or less moves the
    # weights by about 1e-2.
    expected, history = one_device_run(weights(out / "start.npz"), optimizer, steps=10,
                                       epochs=1, precision="mixed_float16", inf_at_step=3)
    assert (history["iterations"], history["loss_scale"]) == (9, 2.0 ** 14)
    assert max_difference(weights_by_rank[0], expected) < MIXED_TOLERANCE


@pytest.mark.requires_mpi
@pytest.mark.requires_horovod
@pytest.mark.multiprocess
def test_without_agreement_the_rank_that_did_not_skip_waits_alone(tmp_path):
    # Keras's LossScaleOptimizer decides per rank: rank 1 skips step 3, rank 0 enters
    # the allreduce alone and waits for ever. Horovod's stall shutdown makes the hang
    # an error within seconds.
    stall = {"HOROVOD_STALL_CHECK_TIME_SECONDS": "2", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "5"}
    exports = [arg for name in stall for arg in ("-x", name)]
    result = run_command(mpirun(*exports, sys.executable, SCRIPT, str(tmp_path),
                                "--precision=mixed_float16", "--inf_at_step=3", "--epochs=1",
                                "--optimizer=adam", "--without=agreement"),
                         cwd=tmp_path, env=stall, timeout=90)
    assert result.returncode != 0
    assert "Horovod has been shut down" in result.stdout + result.stderr


@pytest.mark.requires_mpi
@pytest.mark.requires_horovod
@pytest.mark.multiprocess
def test_bare_horovod_keras_fails_on_keras_3(tmp_path):
    result = run_command(mpirun(sys.executable, SCRIPT, str(tmp_path), "--bare"), cwd=tmp_path)
    assert result.returncode != 0
    assert "'Variable' object has no attribute 'ref'" in result.stdout + result.stderr


@pytest.mark.parametrize("launcher, precision, zero_stage", [
    ("mpirun", "float32", 0), ("horovodrun", "mixed_bfloat16", 2)])
@pytest.mark.requires_mpi
@pytest.mark.requires_horovod
@pytest.mark.multiprocess
def test_tfdist_train_under_a_launcher(launcher, precision, zero_stage, tmp_path):
    # Sharded state under horovodrun: its reduce-scatter and all-gather over Gloo.
    train = [TFDIST, "train", "--strategy=horovod", f"--precision={precision}",
             f"--zero_stage={zero_stage}", "--set", "train.epochs=3"]
    if launcher == "mpirun":
        command = mpirun(*train)
    else:
        command = horovodrun(*train)
    result = run_command(command, cwd=tmp_path, timeout=120)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    # The chief's own file (the launchers interleave the ranks' output).
    summary = json.loads((tmp_path / "tfdist_output" / "result.json").read_text())
    assert (summary["strategy"], summary["replicas"], summary["precision"]) == (
        "horovod", 2, precision)
    assert summary["zero_stage"] == zero_stage
    assert summary["accuracy"] > 0.85


@pytest.mark.requires_mpi
@pytest.mark.requires_horovod
@pytest.mark.multiprocess
def test_users_model_with_batchnorm_dropout_validation_and_evaluate(tmp_path):
    # Each rank's stdout goes to its own file: mpirun interleaves the ranks' output.
    example = f"{sys.executable} {REPO / 'examples' / 'keras_fit.py'} --strategy=horovod --epochs=2"
    result = run_command(mpirun("sh", "-c", f"{example} > stdout$OMPI_COMM_WORLD_RANK.txt"),
                         cwd=tmp_path, timeout=120)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    outputs = [(tmp_path / f"stdout{rank}.txt").read_text() for rank in (0, 1)]
    assert not any(line.startswith("{") for line in outputs[1].splitlines())  # rank 0 reports
    summary = last_json_line(outputs[0])
    assert summary["replicas"] == 2
    assert summary["evaluate_accuracy"] > 0.5 and summary["val_accuracy"] > 0.5


@pytest.mark.multiprocess
@pytest.mark.refuses
def test_without_horovod_one_line_says_how_to_install(tmp_path):
    # A None entry in sys.modules makes `import horovod` raise ImportError, as when
    # Horovod is not installed.
    code = ("import sys; sys.modules['horovod'] = None; from tfdist.app.cli import main; "
            "main(['tfdist', 'train', '--strategy=horovod'])")
    result = run_command([sys.executable, "-c", code], cwd=tmp_path)
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("tfdist: error:")]
    assert len(errors) == 1 and "make setup" in errors[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr


@pytest.mark.requires_horovod
@pytest.mark.multiprocess
def test_a_lone_process_says_once_that_it_is_one_rank(tmp_path):
    result = run_command([TFDIST, "train", "--strategy=horovod", "--set", "train.epochs=1",
                          "--set", "train.dataset=synthetic", "--set",
                          "train.synthetic_examples=128"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    root = " --allow-run-as-root" if os.geteuid() == 0 else ""
    notice = (f"tfdist: strategy horovod runs as 1 rank (started without mpirun or "
              f"horovodrun); start N ranks with mpirun{root} -np N or horovodrun -np N to "
              f"train on N")
    assert result.stderr.splitlines().count(notice) == 1, result.stderr[-2000:]
    assert last_json_line(result.stdout)["replicas"] == 1


@pytest.mark.requires_mpi
@pytest.mark.requires_horovod
@pytest.mark.multiprocess
@pytest.mark.parametrize("refused, line", [
    ("--set horovod.op=adasum", "power-of-2 number of ranks"),
    ("--set train.global_batch_size=64", "global_batch_size 64 does not divide across 3")])
@pytest.mark.refuses
def test_adasum_or_a_batch_that_does_not_divide_by_3_ranks_is_one_line(refused, line, tmp_path):
    # Each rank's stderr goes to its own file: mpirun may interleave the ranks' output.
    train = f"{TFDIST} train --strategy=horovod {refused}"
    result = run_command(mpirun("sh", "-c", f"{train} 2> stderr$OMPI_COMM_WORLD_RANK.txt",
                                processes=3), cwd=tmp_path)
    assert result.returncode == 2
    outputs = [path.read_text() for path in sorted(tmp_path.glob("stderr*.txt"))]
    said = [[line for line in text.splitlines() if line.startswith("tfdist: error:")]
            for text in outputs]
    # mpirun stops the other ranks when the first exits, so 1 to 3 of them say it, once.
    said = [lines for lines in said if lines]
    assert said and all(len(lines) == 1 and line in lines[0] for lines in said), outputs
    assert not any("Traceback" in text for text in outputs)


@pytest.mark.requires_mpi
@pytest.mark.requires_horovod
@pytest.mark.multiprocess
@pytest.mark.refuses
def test_the_drop_ins_adasum_on_3_ranks_is_one_line(tmp_path):
    # Horovod's own API through tfdist's drop-in: Adasum needs a power-of-2 number of ranks.
    program = ("import keras, tfdist.horovod.keras as hvd; hvd.init(); "
               "hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), op=hvd.Adasum)")
    result = run_command(mpirun("sh", "-c", f"{sys.executable} -c '{program}' "
                                "2> stderr$OMPI_COMM_WORLD_RANK.txt", processes=3), cwd=tmp_path)
    assert result.returncode != 0
    lasts = [path.read_text().strip().splitlines()[-1:]
             for path in sorted(tmp_path.glob("stderr*.txt"))]
    # mpirun stops the other ranks when the first exits, so 1 to 3 of them say it.
    said = [last[0] for last in lasts if last and "ConfigError" in last[0]]
    assert said and all(line.startswith("tfdist.errors.ConfigError: op Adasum needs a "
                                        "power-of-2 number of ranks") for line in said), lasts


def test_bad_horovod_options_are_one_line():
    with pytest.raises(tfdist.ConfigError, match="horovod.warmup_steps must be 0 unless"):
        tfdist.load_config(overrides={"horovod.warmup_steps": 10})
    with pytest.raises(tfdist.ConfigError, match="unknown horovod.op 'mean'"):
        tfdist.load_config(overrides={"horovod.op": "mean"})


@pytest.mark.requires_horovod
@pytest.mark.multiprocess
def test_a_gloo_run_reports_its_rank_in_the_environment(tmp_path):
    # horovodrun sets HOROVOD_RANK/SIZE; `tfdist env` sees them and auto picks horovod.
    # Each rank writes its own file: horovodrun interleaves the ranks' output.
    result = run_command(horovodrun("sh", "-c", f"{TFDIST} env --json > env$HOROVOD_RANK.json"),
                         cwd=tmp_path)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    reports = [json.loads((tmp_path / f"env{rank}.json").read_text()) for rank in (0, 1)]
    assert [report["auto"]["strategy"] for report in reports] == ["horovod", "horovod"]
