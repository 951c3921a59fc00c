"""`tfdist supervise`: a scheduler's SIGTERM goes to the training processes, not the
launcher, and the exit status says preemption (143).

Here the launcher is a small Python program standing where `mpirun` stands (it starts
a "rank" and reports whether it was signalled itself); the rank is a real tfdist
`PreemptionWatch`. Real `mpirun` and `horovodrun` under `tfdist supervise`, training,
are in `tests/resume/test_backup.py`.
"""

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import TFDIST, run_command

pytestmark = pytest.mark.multiprocess

# A rank: watches for SIGTERM as tfdist's training does, writes its pid, and on the
# signal records that it stops for a restart and exits with 143.
RANK = """
import os, sys, time
from tfdist.resume.preemption import RESTART_EXIT_CODE, PreemptionWatch
watch = PreemptionWatch(grace_seconds=30)
watch.install()
with open(sys.argv[1] + ".part", "w") as started:
    started.write(str(os.getpid()))
os.replace(sys.argv[1] + ".part", sys.argv[1])
while not watch.signalled:
    time.sleep(0.05)
watch.stopping_for_restart()
sys.exit(RESTART_EXIT_CODE)
"""

# A launcher, as mpirun or horovodrun: starts the rank, writes "signalled" if it gets
# SIGTERM itself, and exits with `sys.argv[3]` (horovodrun --gloo exits with 1) once the
# rank has ended.
LAUNCHER = """
import signal, subprocess, sys
signal.signal(signal.SIGTERM, lambda *_: open(sys.argv[2], "w").write("signalled"))
rank = subprocess.Popen([sys.executable, "-c", sys.argv[4], sys.argv[1]])
while rank.poll() is None:
    try:
        rank.wait()
    except InterruptedError:
        pass
sys.exit(int(sys.argv[3]))
"""


def start_supervised(tmp_path, *command, grace_seconds=30):
    log = open(tmp_path / "supervise.log", "w")
    return subprocess.Popen([TFDIST, "supervise", "--grace_seconds", str(grace_seconds), "--",
                             *command], cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL)


def wait_for(path, process, seconds=30):
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert process.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)


def test_sigterm_reaches_the_registered_rank_not_the_launcher_and_exits_143(tmp_path):
    started, launcher_signalled = tmp_path / "started", tmp_path / "launcher-signalled"
    process = start_supervised(tmp_path, sys.executable, "-c", LAUNCHER, str(started),
                               str(launcher_signalled), "1", RANK)
    wait_for(started, process)
    begun = time.monotonic()
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 143
    assert time.monotonic() - begun < 15  # not the 30 s grace: the rank ended it
    assert not launcher_signalled.exists()


def test_a_launcher_failing_after_a_rank_stopped_for_a_restart_exits_143(tmp_path):
    # No signal to the supervisor: the rank is signalled directly (as srun, or a node's
    # own SIGTERM, does), stops for a restart, and the launcher then exits with 1.
    started, launcher_signalled = tmp_path / "started", tmp_path / "launcher-signalled"
    process = start_supervised(tmp_path, sys.executable, "-c", LAUNCHER, str(started),
                               str(launcher_signalled), "1", RANK)
    wait_for(started, process)
    os.kill(int(started.read_text()), signal.SIGTERM)
    assert process.wait(timeout=30) == 143
    assert not launcher_signalled.exists()


def test_with_no_rank_registered_the_launcher_gets_the_sigterm(tmp_path):
    signalled = tmp_path / "signalled"
    trap = ("import signal, sys, time; "
            f"signal.signal(signal.SIGTERM, lambda *_: (open({str(signalled)!r}, 'w'), "
            "sys.exit(0))); open(sys.argv[1], 'w'); time.sleep(60)")
    process = start_supervised(tmp_path, sys.executable, "-c", trap, str(tmp_path / "up"))
    wait_for(tmp_path / "up", process)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=10) == 143
    assert signalled.exists()


def test_a_launcher_that_outlives_the_grace_period_is_stopped(tmp_path):
    stubborn = ("import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "open(sys.argv[1], 'w'); time.sleep(120)")
    process = start_supervised(tmp_path, sys.executable, "-c", stubborn, str(tmp_path / "up"),
                               grace_seconds=1)
    wait_for(tmp_path / "up", process)
    process.send_signal(signal.SIGINT)
    # 1 s of grace, SIGTERM ignored, SIGKILL 5 s later: not the launcher's 120 s.
    assert process.wait(timeout=30) == 130


def test_the_launchers_own_status_passes_through(tmp_path):
    assert run_command([TFDIST, "supervise", "--", "sh", "-c", "exit 3"],
                       cwd=tmp_path).returncode == 3
    assert run_command([TFDIST, "supervise", "--", "true"], cwd=tmp_path).returncode == 0
