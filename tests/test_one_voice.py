"""One voice per run: under several processes, only the chief prints Keras's progress bars
and tfdist's status lines, unless `every_process_prints: true`.

The docs' Runner pattern (tests/scripts/one_voice.py) with `model.fit` at its defaults,
under `tfdist launch -n 2` (multi_worker) and `mpirun -np 2` (horovod): two epochs, then a
restart that resumes from the checkpoint and trains a third. Each epoch's header ("Epoch
1/2", which Keras's progress bar prints) is counted in the launcher's output.
"""

import sys

import pytest

from tests.conftest import REPO, TFDIST, mpirun, run_command

pytestmark = [pytest.mark.multiprocess, pytest.mark.xdist_group("one_voice")]

SCRIPT = str(REPO / "tests" / "scripts" / "one_voice.py")
LAUNCHERS = {"multi_worker": [TFDIST, "launch", "-n", "2", "--"],
             "horovod": mpirun(processes=2)}
LAUNCH_BOUND_SECONDS = 240  # a hang bound: a small model, a few epochs


def train(tmp_path, strategy, epochs, *options):
    result = run_command([*LAUNCHERS[strategy], sys.executable, SCRIPT, "--strategy", strategy,
                          "--epochs", str(epochs), "--checkpoint_dir", str(tmp_path / "ckpt"),
                          *options], cwd=tmp_path, timeout=LAUNCH_BOUND_SECONDS)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    return result.stdout + result.stderr


@pytest.mark.requires_mpi
@pytest.mark.requires_horovod
@pytest.mark.parametrize("strategy", sorted(LAUNCHERS))
def test_the_chief_alone_prints_progress_and_status(tmp_path, strategy):
    first = train(tmp_path, strategy, 2)
    assert first.count("Epoch 1/2") == 1 and first.count("Epoch 2/2") == 1, first[-3000:]
    resumed = train(tmp_path, strategy, 3)
    assert resumed.count("tfdist: resuming from") == 1, resumed[-3000:]
    assert resumed.count("Epoch 3/3") == 1 and "Epoch 1/3" not in resumed, resumed[-3000:]


@pytest.mark.requires_mpi
@pytest.mark.requires_horovod
def test_every_process_prints_when_asked(tmp_path):
    said = train(tmp_path, "horovod", 2, "--every_process_prints")
    assert said.count("Epoch 1/2") == 2, said[-3000:]
