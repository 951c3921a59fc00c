"""multi_worker under Keras 3 model.fit, with real local processes started by tfdist launch."""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest

import tfdist
from tfdist.cluster import ClusterInfo
from tfdist.app.launch import task_output
from tests import reference
from tests.conftest import REPO, TFDIST, last_json_line, run_command


SCRIPT = str(REPO / "tests" / "scripts" / "multi_worker_weights.py")
TOLERANCE = 1e-5


def chief_json(stdout):
    """The JSON object on the last line worker 0 (the chief) printed under tfdist launch."""
    # stderr is merged in, so a TensorFlow warning at exit may follow the JSON line.
    return last_json_line("\n".join(line for line in task_output(stdout, "worker:0")
                                    if line.startswith("{")))


def launch(args, tmp_path, workers=2, timeout=90):
    return run_command([TFDIST, "launch", "-n", str(workers), "--", *args], cwd=tmp_path,
                       timeout=timeout)


def one_device_weights(optimizer):
    sys.path.insert(0, str(REPO / "tests" / "scripts"))
    import multi_worker_weights as job
    import tensorflow as tf

    start = reference.initial_weights()
    runner = tfdist.Runner(tfdist.load_config(overrides={"strategy": "one_device",
                                                         "precision": "float32"}))
    with runner.scope():
        model = reference.make_model()
        model.set_weights(start)
        model.compile(runner.optimizer(reference.make_optimizer(optimizer)),
                      "sparse_categorical_crossentropy")
    features = tf.data.Dataset.from_tensor_slices(reference.examples(job.EXAMPLES))
    model.fit(runner.dataset(features, job.GLOBAL_BATCH),
              epochs=job.EPOCHS, shuffle=False, verbose=0)
    return model.get_weights(), start


@pytest.mark.multiprocess
def test_launch_train_multi_worker_reports_two_replicas(tmp_path):
    # Bytes, decoded as they are: text mode would turn the progress bar's "\r" into "\n".
    process = subprocess.run([TFDIST, "launch", "-n", "2", "--", TFDIST, "train",
                              "--strategy=multi_worker", "--set", "train.epochs=2"],
                             cwd=tmp_path, capture_output=True, timeout=90,
                             stdin=subprocess.DEVNULL,
                             env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    result = subprocess.CompletedProcess(process.args, process.returncode,
                                         process.stdout.decode(), process.stderr.decode())
    assert result.returncode == 0, result.stdout[-3000:]
    summary = chief_json(result.stdout)
    assert summary["strategy"] == "multi_worker"
    assert summary["replicas"] == 2
    assert summary["accuracy"] > 0.8
    assert not any(line.startswith("[worker:1] {") for line in result.stdout.splitlines())
    assert (tmp_path / "tfdist_output" / "config.yaml").exists()  # written once, by the chief
    # The chief's progress bar: one updating line per epoch on a terminal (each line as
    # its last rewrite after "\r"), not one line per refresh.
    shown = [line.rsplit("\r", 1)[-1] for line in result.stdout.split("\n")]
    bars = [line for line in shown if line.startswith("[worker:0] ") and "/step" in line]
    assert len(bars) == 2, shown


@pytest.mark.parametrize("cpu_replicas, optimizer, replicas, bytes_per_pack", [
    (0, "sgd", 2, 0), (0, "adam", 2, 0), (2, "sgd", 4, 0),
    (0, "adam", 2, 256)])  # packs of 256 bytes: the gradients in several all-reduces
@pytest.mark.multiprocess
def test_equals_one_device(cpu_replicas, optimizer, replicas, bytes_per_pack, tmp_path):
    out = tmp_path / "weights.npz"
    result = launch([sys.executable, SCRIPT, str(out), f"--cpu_replicas={cpu_replicas}",
                     f"--optimizer={optimizer}", f"--bytes_per_pack={bytes_per_pack}"], tmp_path)
    assert result.returncode == 0, result.stdout[-3000:]
    assert f"[worker:1] replicas={replicas} iterations=20" in result.stdout
    distributed = [array for _, array in sorted(np.load(out).items(),
                                                key=lambda item: int(item[0].split("_")[1]))]
    keras.backend.clear_session()
    reference, start = one_device_weights(optimizer)
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(reference, start)) > 1e-2
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(distributed, reference)) < TOLERANCE


@pytest.mark.multiprocess
def test_a_cluster_of_two_host_names_equals_one_device(tmp_path):
    # Two hosts as TF_CONFIG names them on two machines, both this one: each worker is the
    # only task of its host, and the data sharding and the all-reduce follow the task's
    # index in the whole cluster. Each worker's output goes to its own file.
    from tfdist.app.launch import free_ports

    first, second = free_ports(2)
    workers = [f"localhost:{first}", f"127.0.0.1:{second}"]
    out = tmp_path / "weights.npz"
    processes = []
    for index in (0, 1):
        tf_config = json.dumps({"cluster": {"worker": workers},
                                "task": {"type": "worker", "index": index}})
        with open(tmp_path / f"worker{index}.txt", "w") as output:
            processes.append(subprocess.Popen(
                [sys.executable, SCRIPT, str(out), "--optimizer=sgd"], cwd=tmp_path,
                stdout=output, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env={**os.environ, "TF_CONFIG": tf_config, "TF_CPP_MIN_LOG_LEVEL": "2"}))
    try:
        statuses = [process.wait(timeout=120) for process in processes]
    finally:
        for process in processes:
            process.kill()
    outputs = [(tmp_path / f"worker{index}.txt").read_text() for index in (0, 1)]
    assert statuses == [0, 0], [output[-2000:] for output in outputs]
    assert all("replicas=2 iterations=20" in output for output in outputs)
    distributed = [array for _, array in sorted(np.load(out).items(),
                                                key=lambda item: int(item[0].split("_")[1]))]
    keras.backend.clear_session()
    reference, _ = one_device_weights("sgd")
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(distributed, reference)) < TOLERANCE


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.multiprocess
def test_accumulating_4_micro_batches_equals_one_device(optimizer, tmp_path):
    # Micro-batches of 16 (8 per worker), 4 per update: the 20 updates of batch 64, and
    # one gradient all-reduce per update, not per micro-batch.
    out = tmp_path / "weights.npz"
    result = launch([sys.executable, SCRIPT, str(out), f"--optimizer={optimizer}",
                     "--accumulation_steps=4"], tmp_path)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "[worker:1] replicas=2 iterations=20 reductions=20 " in result.stdout
    distributed = [array for _, array in sorted(np.load(out).items(),
                                                key=lambda item: int(item[0].split("_")[1]))]
    keras.backend.clear_session()
    reference, _ = one_device_weights(optimizer)
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(distributed, reference)) < TOLERANCE


@pytest.mark.parametrize("keras_own", [False, True])
@pytest.mark.multiprocess
def test_mixed_float16_inf_on_one_worker_skips_the_step_on_both(keras_own, tmp_path):
    # An inf in worker 1's half of step 3 (each epoch). Keras's LossScaleOptimizer decides
    # per worker: worker 0 enters the gradient all-reduce alone and waits, here until
    # multi_worker.timeout_seconds (10 s) turns the hang into an error.
    out = tmp_path / "weights.npz"
    result = launch([sys.executable, SCRIPT, str(out), "--inf_at_step=3"]
                    + (["--keras_loss_scaling"] if keras_own else []), tmp_path)
    if keras_own:
        assert result.returncode != 0
        assert "Collective has timed out during execution" in result.stdout
        return
    assert result.returncode == 0, result.stdout[-3000:]
    for worker in (0, 1):  # 20 steps, 2 skipped on both
        assert f"[worker:{worker}] replicas=2 iterations=18 " in result.stdout
    assert all(np.all(np.isfinite(array)) for array in np.load(out).values())


@pytest.mark.multiprocess
def test_bare_stack_fails_in_model_fit(tmp_path):
    result = launch([sys.executable, SCRIPT, str(tmp_path / "w.npz"), "--bare"], tmp_path)
    assert result.returncode != 0
    assert "Attempt to convert a value (PerReplica" in result.stdout


@pytest.mark.parametrize("fix, symptom", [
    ("symbolic_build", "Attempt to convert a value (PerReplica"),
    ("metric_reduction", "Invalid reduction dimension 0 for input with 0 dimensions")])
@pytest.mark.multiprocess
def test_each_keras_fix_is_needed(fix, symptom, tmp_path):
    result = launch([sys.executable, SCRIPT, str(tmp_path / "w.npz"), f"--undo={fix}"], tmp_path)
    assert result.returncode != 0
    assert symptom in result.stdout


@pytest.mark.multiprocess
def test_users_model_with_batchnorm_dropout_validation_and_evaluate(tmp_path):
    result = launch([sys.executable, str(REPO / "examples" / "keras_fit.py"),
                     "--strategy=multi_worker", "--epochs=2"], tmp_path)
    assert result.returncode == 0, result.stdout[-3000:]
    summary = chief_json(result.stdout)
    assert summary["replicas"] == 2
    assert summary["evaluate_accuracy"] > 0.5 and summary["val_accuracy"] > 0.5


@pytest.mark.multiprocess
@pytest.mark.refuses
def test_batch_that_does_not_divide_fails_on_every_worker_with_one_line(tmp_path):
    result = launch([TFDIST, "train", "--strategy=multi_worker",
                     "--set", "train.global_batch_size=63"], tmp_path)
    assert result.returncode == 2
    assert "global_batch_size 63 does not divide across 2 replicas" in result.stdout
    assert "Traceback" not in result.stdout


# One worker of its own cluster, in a fresh process: each program ends in a refusal.
ONE_WORKER = ("import sys, tensorflow as tf, tfdist\n"
              "from tfdist.app.launch import free_ports\n"
              "def runner(**settings):\n"
              "    return tfdist.Runner(tfdist.load_config(overrides={\n"
              "        'strategy': 'multi_worker',\n"
              "        'multi_worker.workers': [f'localhost:{free_ports(1)[0]}'], **settings}))\n")


@pytest.mark.parametrize("program, message", [
    ("tf.constant(1.0) + 1\nrunner()",
     "strategy multi_worker must start before TensorFlow runs any op"),
    ("runner(**{'multi_worker.cpu_replicas': 2}).dataset(\n"
     "    lambda context: tf.data.Dataset.range(8), 4)",
     "a dataset function with more than one replica per worker is not supported yet"),
])
@pytest.mark.multiprocess
@pytest.mark.refuses
def test_what_a_worker_cannot_do_is_one_line(program, message, tmp_path):
    result = run_command([sys.executable, "-c", ONE_WORKER + program], cwd=tmp_path)
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"tfdist.errors.ConfigError: {message}"), result.stderr[-2000:]


def test_no_cluster_is_one_line():
    with pytest.raises(tfdist.ConfigError, match="found no cluster"):
        tfdist.Runner(tfdist.load_config(overrides={"strategy": "multi_worker"}),
                      cluster=ClusterInfo())


def two_consecutive_free_ports() -> int:
    """A port p such that p and p + 1 are both free now (Slurm gives a node's tasks p, p+1)."""
    import socket

    from tfdist.app.launch import free_ports

    for _ in range(100):
        (port,) = free_ports(1)
        if port >= 65000:
            continue
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two consecutive free ports found")


@pytest.mark.multiprocess
def test_a_slurm_job_step_trains_without_tf_config(tmp_path):
    # Two processes with the variables srun sets for 2 tasks on one node, no TF_CONFIG.
    import os
    import subprocess

    port = two_consecutive_free_ports()
    children = []
    for rank in range(2):
        env = {"SLURM_JOB_ID": "1", "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank),
               "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NODELIST": "localhost",
               "SLURM_STEP_TASKS_PER_NODE": "2"}
        children.append(subprocess.Popen(
            [TFDIST, "train", "--strategy=auto", "--set", "train.epochs=1",
             "--set", f"multi_worker.slurm_port_base={port}"],
            cwd=tmp_path, env={**os.environ, **env}, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True))
    outputs = [child.communicate(timeout=90)[0] for child in children]
    assert [child.returncode for child in children] == [0, 0], outputs[0][-2000:]
    summary = last_json_line(outputs[0])
    assert summary["strategy"] == "multi_worker"  # auto chose it from Slurm's 2 tasks
    assert summary["replicas"] == 2
    assert not any(line.startswith("{") for line in outputs[1].splitlines())  # chief only


@pytest.mark.multiprocess
def test_only_the_chief_leaves_files(tmp_path):
    # Each worker runs in its own folder, so a file left by worker 1 would show.
    for index in (0, 1):
        (tmp_path / f"w{index}").mkdir()
    script = ("import os, json, subprocess, sys; "
              "index = json.loads(os.environ['TF_CONFIG'])['task']['index']; "
              "os.chdir(f'w{index}'); "
              "sys.exit(subprocess.call(sys.argv[1:]))")
    result = launch([sys.executable, "-c", script, TFDIST, "train", "--strategy=multi_worker",
                     "--set", "train.epochs=1", "--set", "train.tensorboard=true"], tmp_path)
    assert result.returncode == 0, result.stdout[-3000:]
    chief = tmp_path / "w0" / "tfdist_output"
    assert (chief / "config.yaml").exists() and (chief / "result.json").exists()
    assert list((chief / "tensorboard").rglob("events.out.tfevents.*"))
    assert list((tmp_path / "w1").iterdir()) == []  # nothing kept by worker 1


def test_writable_dir_is_the_folder_itself_on_the_chief(tmp_path):
    runner = tfdist.Runner(tfdist.load_config(overrides={"strategy": "one_device"}))
    assert runner.writable_dir(tmp_path / "tb") == str(tmp_path / "tb")
    assert (tmp_path / "tb").is_dir()
