"""Preemption: a SIGTERM to any process stops every process at one agreed step.

A cluster scheduler (Kubernetes, Slurm, a spot or preemptible VM) announces that
it will take a machine back with SIGTERM, and kills the process a grace period
later (often 30 seconds). The processes of a synchronous job must then stop at
the same step: one that stops early leaves the others waiting in a collective,
one that stops late trains a step the others never take. `PreemptionWatch`
catches the signal; a `StopAgreement` from the adapter decides the step:

- `LocalStop`: one process (one_device, mirrored, tpu, the parameter-server
  chief) stops at its next step boundary.
- `CoordinatedStop`: `multi_worker`. TensorFlow's own protocol
  (`tf.distribute.experimental.PreemptionCheckpointHandler`), through the
  coordination service's key-value store: the signalled worker proposes the step
  after the one it has finished and waits until every worker has read the
  proposal. Workers run each step's collectives together, so none can have
  passed that step while the proposer waits. No cost per step.
- `VotedStop`: `horovod`. Each rank's flag rides with the gradients' reduction (one
  more scalar in the same Horovod cycle), so every rank reads the same vote after the
  same update, at no cost per step; the stop comes at the first boundary after an
  update that carried a raised flag.

Every process then saves, and exits with `RESTART_EXIT_CODE`. A process that
has not exited `grace_seconds` after the signal exits with it anyway, without
saving: the newest checkpoint is still intact.

Under `tfdist supervise` (`mpirun`, `horovodrun`), a watching process registers
(`Registration`): the supervisor passes its SIGTERM to it, and reads from it that
it stopped to be restarted.

Example:

    watch = PreemptionWatch(grace_seconds=25)
    watch.install()
    ...                                   # at each step boundary, on every process:
    if agreement.should_stop(boundary, watch.signalled):
        save(); raise SystemExit(RESTART_EXIT_CODE)
"""

from __future__ import annotations

import abc
import contextlib
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from absl import logging

from tfdist.cluster import supervisor_folder

# 128 + SIGTERM: what a shell reports for a process ended by SIGTERM, and an exit code
# Kubeflow's `restartPolicy: ExitCode` treats as retryable (it retries 128-255 and
# treats 1-127 as permanent). `tfdist launch --max_restarts` restarts on it.
RESTART_EXIT_CODE = 143

# Between the proposal of a step and its acknowledgement by every worker: a worker's
# watcher thread answers at once, so this only bounds the wait when a peer is gone.
_ACKNOWLEDGE_TIMEOUT_MS = 10_000


class PreemptionWatch:
    """Catches SIGTERM, remembers it, and ends the process if it is not done in time.

    Args:
        grace_seconds: After the signal, the process exits with `RESTART_EXIT_CODE`
            this long later if it is still running.

    Example:

        watch = PreemptionWatch(grace_seconds=25)
        if watch.install():
            ...
            watch.uninstall()
    """

    def __init__(self, grace_seconds: float):
        self.grace_seconds = grace_seconds
        self.signalled_at: float | None = None
        self._previous: Any = None
        self._installed = False
        self._deadline: threading.Timer | None = None
        self._registration = Registration(None)

    @property
    def signalled(self) -> bool:
        """Whether this process has received SIGTERM since `install`."""
        return self.signalled_at is not None

    def install(self) -> bool:
        """Handles SIGTERM from now on. False (with a warning) off the main thread."""
        if self._installed:
            return True
        try:
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)
        except ValueError:  # Signals can be handled on the main thread only.
            logging.warning("tfdist: model.fit runs outside the main thread, so SIGTERM cannot "
                            "be caught: a preempted process stops without saving, and the "
                            "run resumes from its last periodic checkpoint.")
            return False
        self._installed = True
        # After the handler: a supervisor that reads the registration may signal at once.
        self._registration = Registration.create()
        return True

    def stopping_for_restart(self) -> None:
        """Records, for a supervisor, that this process exits with `RESTART_EXIT_CODE`."""
        self._registration.say(Registration.RESTART)

    def uninstall(self) -> None:
        """Gives SIGTERM back to the previous handler, and delivers a signal left unanswered.

        A signal that arrived after the last step boundary (during the last
        validation, say) was not acted on: the previous handler gets it now, so a
        preempted process still ends.
        """
        if not self._installed:
            return
        signal.signal(signal.SIGTERM, self._previous)
        self._installed = False
        self._registration.remove()
        if self._deadline is not None:
            self._deadline.cancel()
        if self.signalled:
            os.kill(os.getpid(), signal.SIGTERM)

    def _on_signal(self, signum: int, frame: Any) -> None:
        del signum, frame
        if self.signalled:
            return
        self.signalled_at = time.monotonic()
        # The handler runs between two Python instructions of the main thread: it only
        # records the signal. The training loop acts on it at its next step boundary.
        self._deadline = threading.Timer(self.grace_seconds, self._out_of_time)
        self._deadline.daemon = True
        self._deadline.start()

    def _out_of_time(self) -> None:
        print(f"tfdist: preempted: no step boundary was reached within "
              f"checkpoint.grace_seconds={self.grace_seconds:g} of SIGTERM; exiting without "
              f"saving (status {RESTART_EXIT_CODE}); a restart resumes from the newest "
              f"checkpoint", file=sys.stderr, flush=True)
        self.stopping_for_restart()
        os._exit(RESTART_EXIT_CODE)


class Registration:
    """This process's file in `tfdist supervise`'s folder: `PID@HOST`, holding its state.

    Outside a supervisor (no folder in the environment) it does nothing.

    Args:
        path: The file, or None (nothing to record).

    Example:

        registration = Registration.create()   # "training"
        registration.say(Registration.RESTART)  # it saved and exits with 143
    """

    TRAINING = "training"
    RESTART = "restart"

    def __init__(self, path: Path | None):
        self.path = path

    @classmethod
    def create(cls) -> "Registration":
        """Registers this process as training, if a supervisor watches this host."""
        folder = supervisor_folder()
        if folder is None or not os.path.isdir(folder):
            # Not supervised, or a rank on another host than the supervisor's.
            return cls(None)
        registration = cls(Path(folder) / f"{os.getpid()}@{socket.gethostname()}")
        registration.say(cls.TRAINING)
        return registration

    def say(self, state: str) -> None:
        if self.path is not None:
            with contextlib.suppress(OSError):  # The supervisor has gone: nobody reads it.
                self.path.write_text(state)

    def remove(self) -> None:
        if self.path is not None:
            with contextlib.suppress(OSError):
                self.path.unlink()


class StopAgreement(abc.ABC):
    """Decides, identically on every process, at which step boundary to stop.

    `should_stop` is called by every process at every step boundary, in the same
    order; boundaries are numbered from 1 within one `fit`.

    Attributes:
        needs_retrace: The model's training step, traced before, must be traced again
            to take part in the agreement.
    """

    needs_retrace = False

    def start(self) -> None:
        """Starts whatever the agreement listens with (called at the start of `fit`)."""

    def close(self) -> None:
        """Releases it (called at the end of `fit`)."""

    @abc.abstractmethod
    def should_stop(self, boundary: int, signalled: bool) -> bool:
        """Whether every process stops at this boundary.

        Args:
            boundary: This boundary's number (1, 2, ...).
            signalled: Whether this process has received SIGTERM.
        """


class LocalStop(StopAgreement):
    """One process: stop at the first boundary after the signal."""

    def should_stop(self, boundary: int, signalled: bool) -> bool:
        return signalled


class VotedStop(StopAgreement):
    """Stop once the vote that travels with the gradients' reduction counts a raised flag.

    The training step adds every process's `flag` into `votes` when it reduces the
    gradients (see `HorovodAdapter.gradient_reduce_fn`). Every process reads the
    same `votes` after the same update, so all stop at the same boundary.

    Args:
        flag: This process's flag, a scalar float32 variable (0 or 1).
        votes: The sum of the flags at the last update, a scalar float32 variable.
        needs_retrace: The training step was traced without the vote.
    """

    def __init__(self, flag: Any, votes: Any, needs_retrace: bool = False):
        self._flag, self._votes = flag, votes
        self._raised = False
        self.needs_retrace = needs_retrace

    def start(self) -> None:
        self._flag.assign(0.0)
        self._votes.assign(0.0)
        self._raised = False

    def should_stop(self, boundary: int, signalled: bool) -> bool:
        if signalled and not self._raised:
            self._flag.assign(1.0)
            self._raised = True
        return float(self._votes.numpy()) > 0


class CoordinatedStop(StopAgreement):
    """The protocol of TensorFlow's `PreemptionCheckpointHandler`, for `model.fit`.

    A watcher thread on every worker blocks on one key of the coordination
    service. The signalled worker writes to it the boundary after the one it has
    reached, then waits until every worker's watcher has acknowledged. While it
    waits, no worker can finish another step (each step's collectives need it), so
    every worker is at most at the proposed boundary, and stops there.

    Args:
        worker_index: This worker's index among `num_workers`.
        num_workers: Workers in the cluster.
        run_key: Distinguishes the keys of one `fit` from another's in the same
            cluster (keys live as long as the cluster does).
    """

    def __init__(self, worker_index: int, num_workers: int, run_key: str):
        from tensorflow.python.eager import context

        self._context = context.context()
        self._index = worker_index
        self._num_workers = num_workers
        self._key = f"tfdist/stop/{run_key}"
        self._agreed: int | None = None
        self._agreed_event = threading.Event()
        self._proposed = False
        self._watcher: threading.Thread | None = None

    def start(self) -> None:
        self._watcher = threading.Thread(target=self._watch, name="tfdist-stop-watcher",
                                         daemon=True)
        self._watcher.start()

    def close(self) -> None:
        self._publish("done")  # Wakes every watcher; a proposal already made stays.
        if self._watcher is not None:
            self._watcher.join(timeout=5)

    def should_stop(self, boundary: int, signalled: bool) -> bool:
        if signalled and not self._proposed and self._agreed is None:
            self._proposed = True
            self._publish(str(boundary + 1))
            self._await_acknowledgements()
        return self._agreed is not None and boundary >= self._agreed

    def _watch(self) -> None:
        value = self._context.get_config_key_value(self._key)
        if value != "done":
            self._agreed = int(value)
        self._agreed_event.set()
        self._context.set_config_key_value(f"{self._key}/ack/{self._index}", "1")

    def _publish(self, value: str) -> None:
        import tensorflow as tf

        try:
            self._context.set_config_key_value(self._key, value)
        except tf.errors.AlreadyExistsError:
            pass  # Another worker proposed first, or the run is over: theirs stands.

    def _await_acknowledgements(self) -> None:
        import tensorflow as tf

        for index in range(self._num_workers):
            try:
                self._context.get_config_key_value(f"{self._key}/ack/{index}",
                                                   _ACKNOWLEDGE_TIMEOUT_MS)
            except tf.errors.DeadlineExceededError:
                logging.warning("tfdist: worker %d did not acknowledge the stop within %d s; "
                                "stopping anyway", index, _ACKNOWLEDGE_TIMEOUT_MS // 1000)
        self._agreed_event.wait(_ACKNOWLEDGE_TIMEOUT_MS / 1000)
