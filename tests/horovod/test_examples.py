"""examples/horovod/ (Horovod's own TF2 Keras examples on tfdist.horovod.keras) and Horovod
elastic with a rank lost, on 2 real ranks. Each rank writes its output to its own file."""

import json
import sys

import pytest

from tests.conftest import REPO, horovodrun, last_json_line, launcher_command, run_command

EXAMPLES = REPO / "examples" / "horovod"
ELASTIC_HOSTS = ["--min-np", "1", "-H", "localhost:1,127.0.0.1:1"]  # elastic needs 2 hosts

pytestmark = [pytest.mark.requires_mpi, pytest.mark.requires_horovod, pytest.mark.multiprocess]


def per_rank_output(command, tmp_path):
    """`command` with each rank's stdout and stderr in tmp_path/rank<R>.txt (mpirun and
    horovodrun name the rank differently)."""
    rank = "${OMPI_COMM_WORLD_RANK:-$HOROVOD_RANK}"
    return ["sh", "-c", f'exec "$@" > {tmp_path}/rank{rank}.txt 2>&1', "sh", *command]


def run_example(launcher, tmp_path, script, *args, hosts=()):
    command = per_rank_output([sys.executable, str(EXAMPLES / script), *args], tmp_path)
    full = (horovodrun(*hosts, *command) if hosts else launcher_command(launcher, *command))
    result = run_command(full, cwd=tmp_path, timeout=150)
    outputs = {path.name: path.read_text() for path in tmp_path.glob("rank*.txt")}
    assert result.returncode == 0, (result.stdout + result.stderr)[-2000:] + str(
        {name: text[-2000:] for name, text in outputs.items()})
    return outputs


@pytest.mark.parametrize("launcher", ["mpirun", "horovodrun"])
def test_keras_mnist_example_trains(launcher, tmp_path):
    outputs = run_example(launcher, tmp_path, "tensorflow2_keras_mnist.py", "--epochs=4",
                          "--steps_per_epoch=40", "--batch_size=32")
    summary = last_json_line(outputs["rank0.txt"])
    assert summary["ranks"] == 2 and summary["epochs"] == 4
    assert summary["accuracy"] > 0.9
    assert summary["lr"] == pytest.approx(0.002)  # warmed up to 0.001 x 2 ranks
    assert "{" not in outputs["rank1.txt"]  # rank 1 prints nothing
    assert sorted(path.name for path in tmp_path.glob("checkpoint-*.keras")) == [
        f"checkpoint-{epoch}.keras" for epoch in (1, 2, 3, 4)]


@pytest.mark.parametrize("launcher", ["mpirun", "horovodrun"])
def test_synthetic_benchmark_example_reports_images_per_second(launcher, tmp_path):
    outputs = run_example(launcher, tmp_path, "tensorflow2_keras_synthetic_benchmark.py",
                          "--no-cuda", "--model=MobileNet", "--image-size=32",
                          "--num-classes=10", "--batch-size=8", "--num-batches-per-iter=2",
                          "--num-iters=3")
    summary = last_json_line(outputs["rank0.txt"])
    assert (summary["ranks"], summary["device"]) == (2, "CPU")
    assert summary["img_sec_total"] == pytest.approx(2 * summary["img_sec_per_device"])
    assert summary["img_sec_per_device"] > 0
    assert "Total img/sec on 2 CPU(s)" in outputs["rank0.txt"]


def test_elastic_mnist_example_runs_under_horovodrun_elastic(tmp_path):
    outputs = run_example("horovodrun", tmp_path, "tensorflow2_keras_mnist_elastic.py",
                          "--epochs=2", "--steps_per_epoch=20", "--batch_size=32",
                          hosts=ELASTIC_HOSTS)
    summary = last_json_line(outputs["rank0.txt"])
    assert (summary["ranks"], summary["epochs_done"]) == (2, 2)


def test_elastic_goes_on_from_the_last_commit_with_the_rank_left(tmp_path):
    script = REPO / "tests" / "scripts" / "horovod_keras_elastic.py"
    result = run_command(horovodrun(*ELASTIC_HOSTS, sys.executable, str(script), str(tmp_path),
                                    "--kill_at=1:5"), cwd=tmp_path, timeout=120)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert (tmp_path / "killed").exists() and not (tmp_path / "rank1.json").exists()
    report = json.loads((tmp_path / "rank0.json").read_text())
    # Rank 1 died after batch 5's allreduce of epoch 1; rank 0 had committed batch 5,
    # restored it, and went on alone.
    assert report["starts"] == [{"size": 2, "epoch": 0, "batch": 0},
                                {"size": 1, "epoch": 1, "batch": 5}]
    assert report["epoch"] == 3 and report["finite"]
    # 8 + 6 updates committed; Keras 3 cannot shorten the interrupted epoch, which then
    # runs its 8 steps again, and the last epoch 8: 30.
    assert report["iterations"] == 8 + 6 + 8 + 8
