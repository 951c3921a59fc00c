"""The Horovod that set-up builds (scripts/install_horovod.sh): its flags, and its
collectives under real `mpirun` and `horovodrun` with 2 ranks. The adapter's own
tests are in tests/adapters/test_horovod.py.
"""

import json
import os
import re
import shutil
import sys

import pytest

from tests.conftest import REPO, TFDIST, run_command

pytestmark = pytest.mark.slow

SCRIPT = str(REPO / "tests" / "scripts" / "horovod_collectives.py")
EXPECTED = ("sum=[3.0,3.0,3.0,3.0] average=[0.5,0.5,0.5]/[1.0,1.0,1.0,1.0] "
            "broadcast=[10.0]")


def mpirun(*args):
    # Open MPI refuses to start as root unless told; containers and CI often are root.
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    return [shutil.which("mpirun"), *root, "--oversubscribe", *args]


def test_built_with_mpi_and_gloo():
    import horovod
    import horovod.tensorflow as hvd

    assert horovod.__version__ == "0.28.1"
    assert hvd.mpi_built() and hvd.gloo_built()


def _check_two_ranks(result):
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    # Launchers prefix and may interleave the ranks' lines, so read the reports wherever they are.
    reports = sorted(re.findall(r"rank=(\d) size=(\d) (sum=\S+ average=\S+ broadcast=\[[\d., ]*\])",
                                result.stdout))
    assert [(rank, size) for rank, size, _ in reports] == [("0", "2"), ("1", "2")], result.stdout
    assert all(values == EXPECTED for _, _, values in reports), reports


def test_collectives_under_mpirun(tmp_path):
    _check_two_ranks(run_command(mpirun("-np", "2", sys.executable, SCRIPT), cwd=tmp_path))


@pytest.mark.parametrize("controller", ["--gloo", "--mpi"])
def test_collectives_under_horovodrun(controller, tmp_path):
    horovodrun = str(REPO / ".venv" / "bin" / "horovodrun")
    extra = ["--mpi-args=--allow-run-as-root --oversubscribe"] if (
        controller == "--mpi" and os.geteuid() == 0) else []
    _check_two_ranks(run_command([horovodrun, controller, *extra, "-np", "2", "-H", "localhost:2",
                                  sys.executable, SCRIPT], cwd=tmp_path))


def test_tfdist_env_reports_the_build(tmp_path):
    report = json.loads(run_command([TFDIST, "env"], cwd=tmp_path).stdout)
    assert report["horovod"] == {"installed": True, "version": "0.28.1", "mpi": True,
                                 "gloo": True, "nccl": False}
