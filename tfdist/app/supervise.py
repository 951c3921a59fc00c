"""Running a launcher (`mpirun`, `horovodrun`) so that a preemption ends it with status 143.

A scheduler that takes a machine back sends SIGTERM to the job's first process,
which under Horovod is the launcher, and reads the exit status to decide what
next: Kubeflow's `restartPolicy: ExitCode` retries 128-255 and gives up on 1-127.
The launchers answer SIGTERM badly for that: Open MPI's `mpirun` passes SIGTERM to
the ranks, kills them one second later (`odls_base_sigkill_timeout`), too soon to
save, and exits with status 1; `horovodrun --gloo` gives them 5 seconds and exits
with 1; and `horovodrun --gloo` also exits with 1 when the ranks stopped with 143
by themselves (a rank's own SIGTERM, from Slurm say).

`tfdist supervise -- LAUNCHER ...` runs the launcher in a session of its own and:

- on SIGTERM (or Ctrl-C), passes SIGTERM to the training processes on this host,
  not to the launcher. Those are the processes whose tfdist training
  (`runner.callbacks`, `tfdist train`) registered in a folder the supervisor names
  in their environment (`tfdist.cluster.supervisor_folder`). One signalled rank is
  enough: the ranks agree on one step, save, and exit with 143
  (`tfdist.resume.preemption`), and the launcher then ends by itself. A rank that
  registers later gets the signal as it registers. With no rank registered yet
  (TensorFlow still loading: nothing to save), the launcher gets the SIGTERM.
- gives the launcher `grace_seconds` to end, then SIGTERM, then SIGKILL 5 s later;
- exits with 143 after SIGTERM and 130 after Ctrl-C (the shell's statuses); else
  with 143 when the launcher failed after a rank here stopped to be restarted; else
  with the launcher's own status.

Example:

    status = supervise(["mpirun", "-np", "2", "tfdist", "train", "--strategy", "horovod"])
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Sequence

from tfdist.app.interruption import interruption_handled
from tfdist.cluster import SUPERVISOR_FOLDER_VARIABLE, child_environment
from tfdist.errors import ConfigError
from tfdist.resume.preemption import RESTART_EXIT_CODE, Registration

_POLL_SECONDS = 0.1
# Between SIGTERM to a launcher that outlived the grace period and SIGKILL.
_KILL_AFTER_SECONDS = 5.0


def supervise(command: Sequence[str], grace_seconds: float = 30.0) -> int:
    """Runs `command` (a launcher) and returns the exit status a scheduler should see.

    Args:
        command: The launcher and its arguments, such as `["mpirun", "-np", "2", ...]`.
        grace_seconds: After SIGTERM or Ctrl-C, how long the ranks have to save and the
            launcher to end before the launcher is stopped. At least the ranks'
            `checkpoint.grace_seconds`.

    Returns:
        143 after SIGTERM, 130 after Ctrl-C; 143 when the launcher failed and a rank on
        this host had stopped to be restarted; else the launcher's status (128 + N when
        signal N ended it).

    Raises:
        ConfigError: an empty command, one not found, or `grace_seconds` <= 0.
    """
    if not command:
        raise ConfigError("tfdist supervise needs a command after '--', such as "
                          "tfdist supervise -- mpirun -np 2 tfdist train --strategy horovod")
    if shutil.which(command[0]) is None:
        raise ConfigError(f"tfdist supervise: command not found: {command[0]}; give a program "
                          f"on PATH or a path to an executable file. Received: "
                          f"{' '.join(command)}")
    if grace_seconds <= 0:
        raise ConfigError(f"tfdist supervise --grace_seconds must be > 0. "
                          f"Received: --grace_seconds {grace_seconds:g}")
    with tempfile.TemporaryDirectory(prefix="tfdist-supervise-") as folder, \
            interruption_handled() as interrupted:
        # A session of its own: a Ctrl-C at the terminal reaches the supervisor only,
        # not the launcher, which would kill the ranks at once.
        launcher = subprocess.Popen(
            list(command), env=child_environment({SUPERVISOR_FOLDER_VARIABLE: folder}),
            start_new_session=True)
        signalled: set[int] = set()
        deadline = None
        while launcher.poll() is None:
            if interrupted.is_set():
                if deadline is None:
                    deadline = time.monotonic() + grace_seconds
                    if not _registered(folder):
                        _signal(launcher.pid, signal.SIGTERM)
                for pid in _registered(folder).keys() - signalled:
                    _signal(pid, signal.SIGTERM)
                    signalled.add(pid)
                if time.monotonic() > deadline:
                    _stop(launcher)
            interrupted.wait(_POLL_SECONDS)
        if interrupted.is_set():
            return 128 + interrupted.signum
        status = 128 - launcher.returncode if launcher.returncode < 0 else launcher.returncode
        if status and Registration.RESTART in _registered(folder).values():
            return RESTART_EXIT_CODE
        return status


def _registered(folder: str) -> dict[int, str]:
    """The training processes of this host in `folder`: pid -> what each last said."""
    found = {}
    host = socket.gethostname()
    for path in Path(folder).iterdir():
        pid, _, path_host = path.name.partition("@")
        if path_host == host and pid.isdigit():
            with contextlib.suppress(OSError):
                found[int(pid)] = path.read_text()
    return found


def _signal(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signum)


def _stop(launcher: subprocess.Popen) -> None:
    """SIGTERM to the launcher's process group, SIGKILL `_KILL_AFTER_SECONDS` later."""
    for signum in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(launcher.pid, signum)
        with contextlib.suppress(subprocess.TimeoutExpired):
            launcher.wait(timeout=_KILL_AFTER_SECONDS)
            return
