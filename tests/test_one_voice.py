"""One voice per run: under several processes, only the chief prints Keras's progress bars
and tfdist's status lines, unless `every_process_prints: true`.

The docs' Runner pattern (tests/scripts/one_voice.py) with `model.fit` at its defaults,
under `tfdist launch -n 2` (multi_worker) and `mpirun -np 2` (horovod): two epochs, then a
restart that resumes from the checkpoint and trains a third. Each epoch's header ("Epoch
1/2", which Keras's progress bar prints) is counted in the launcher's output. And `tfdist
train` shows each epoch's last progress line once, on a terminal and in a log.
"""

import os
import re
import subprocess
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


def last_progress_lines(output: bytes, *, terminal: bool) -> list[str]:
    """The lines showing an epoch's last step ("22/22 ..."): as a terminal shows them (each
    line as its last rewrite after a carriage return), or as a log is read (every carriage
    return, backspace and newline a line break, as Python's universal newlines and many
    log viewers take them)."""
    text = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", output.decode())
    lines = ([line.rsplit("\r", 1)[-1] for line in text.split("\n")] if terminal
             else re.split(r"[\r\n\b]+", text))
    return [line for line in lines if re.search(r"\b(\d+)/\1 ", line)]


def test_tfdist_train_shows_each_epochs_last_progress_line_once(tmp_path):
    def tfdist(*args):
        done = subprocess.run([TFDIST, *args], cwd=tmp_path, capture_output=True,
                              stdin=subprocess.DEVNULL, timeout=LAUNCH_BOUND_SECONDS,
                              env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout

    # Into a pipe (a log file, mpirun's ranks): one line per epoch, however it is read, and
    # no redraws (Keras skips a redraw within 0.05 s of the last, so how many a log holds,
    # the last line's twin included, depends on timing).
    logged = tfdist("train", "--strategy", "one_device", "--set", "train.epochs=2")
    assert len(last_progress_lines(logged, terminal=False)) == 2, logged[-3000:]
    assert b"\r" not in logged and b"\b" not in logged, logged[-3000:]
    # Under tfdist launch, each task writes to a terminal: a bar redrawn in place, which the
    # launcher keeps to one updating line.
    launched = tfdist("launch", "-n", "2", "--", TFDIST, "train", "--strategy", "multi_worker",
                      "--set", "train.epochs=2", "--set", f"train.output_dir={tmp_path / 'mw'}")
    assert len(last_progress_lines(launched, terminal=True)) == 2, launched[-3000:]
