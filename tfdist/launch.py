"""A local multi-process launcher: one machine runs the same code a cluster would.

`tfdist launch -n N [--ps M] [--max_restarts R] -- CMD ...` starts N workers
(and, with `--ps`, M parameter servers and a chief that coordinates them) on
free loopback ports, each with its TF_CONFIG. It is a tool for tests, demos and
single-host runs, not a cluster manager.

- Every output line is prefixed with its task: `[worker:1] Epoch 1/5`.
- Without `--ps`, the group succeeds when every worker exits 0; when one fails,
  the others are stopped (SIGTERM, then SIGKILL after a grace period) and the
  launcher exits non-zero, naming the failed task.
- With `--ps`, the chief decides, as in a real parameter-server cluster: a
  worker or parameter server that exits is reported and left to the chief
  (which reschedules a worker's steps, and stops with an error when a parameter
  server is lost); the group ends with the chief's exit status, and the servers
  still running are then stopped.
- `--max_restarts R` restarts the whole group up to R times after a failure.
- Ctrl-C (or SIGTERM) stops every child. Each child leads its own process group,
  which is what is signalled, so grandchildren go too: no orphans.

Example:

    status = launch(["tfdist", "train", "--strategy", "multi_worker"], num_workers=2)
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import IO, Iterator, Sequence

from tfdist.cluster import child_environment
from tfdist.errors import ConfigError

LOOPBACK = "127.0.0.1"


@dataclasses.dataclass(frozen=True)
class Task:
    """One process of the group."""

    task_type: str
    index: int

    @property
    def name(self) -> str:
        return f"{self.task_type}:{self.index}"


def task_output(text: str, task: str) -> list[str]:
    """The lines one task printed, from the launcher's prefixed output.

    Args:
        text: What the launcher wrote.
        task: The task's name, such as "worker:0" or "chief:0".

    Example:

        json.loads(task_output(output, "worker:0")[-1])   # the chief's last line
    """
    prefix = f"[{task}] "
    return [line[len(prefix):] for line in text.splitlines() if line.startswith(prefix)]


def cluster_spec(num_workers: int, num_ps: int = 0, host: str = LOOPBACK) -> dict[str, list[str]]:
    """A cluster on free ports of `host`: N workers, or a chief, N workers and M ps.

    A port is free when it is picked; another program could take it before the
    task binds it, a race that a single-host tool accepts.
    """
    def addresses(count: int) -> list[str]:
        return [f"{host}:{port}" for port in free_ports(count, host)]

    if num_ps:
        return {"chief": addresses(1), "worker": addresses(num_workers), "ps": addresses(num_ps)}
    return {"worker": addresses(num_workers)}


def free_ports(count: int, host: str = LOOPBACK) -> list[int]:
    """`count` distinct ports that nothing listens on now."""
    with contextlib.ExitStack() as stack:
        sockets = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind((host, 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]


def launch(command: Sequence[str], num_workers: int, num_ps: int = 0, max_restarts: int = 0, *,
           grace_seconds: float = 5.0, output: IO[str] | None = None) -> int:
    """Runs `command` once per task of a local cluster and returns the group's exit status.

    Args:
        command: The program and its arguments; every task runs the same one.
        num_workers: Worker processes (>= 1).
        num_ps: Parameter servers (with a chief to coordinate them), or 0.
        max_restarts: Restarts of the whole group after a failure.
        grace_seconds: How long a stopped process has between SIGTERM and SIGKILL.
        output: Where prefixed lines go. None: standard output.

    Returns:
        0 on success; otherwise the failed task's exit status (at least 1), or 130
        after Ctrl-C.

    Raises:
        ConfigError: bad counts or an empty command.
    """
    if not command:
        raise ConfigError("tfdist launch needs a command after '--', such as "
                          "tfdist launch -n 2 -- tfdist train --strategy multi_worker")
    for name, value, lowest in (("-n", num_workers, 1), ("--ps", num_ps, 0),
                                ("--max_restarts", max_restarts, 0)):
        if value < lowest:
            raise ConfigError(f"tfdist launch {name} must be an integer >= {lowest}. "
                              f"Received: {name} {value}")
    output = sys.stdout if output is None else output
    status, interrupted = 1, threading.Event()
    with _signals_set(interrupted):
        for attempt in range(max_restarts + 1):
            if attempt:
                _say(output, f"restarting the group (restart {attempt} of {max_restarts})")
            status = _Group(list(command), cluster_spec(num_workers, num_ps), output,
                            grace_seconds, interrupted).run()
            if status in (0, 130):
                return status
    return status


def _say(output: IO[str], message: str) -> None:
    print(f"tfdist launch: {message}", file=output, flush=True)


class _Group:
    """One attempt: start every task, relay output, watch, stop."""

    def __init__(self, command: list[str], cluster: dict[str, list[str]], output: IO[str],
                 grace_seconds: float, interrupted: threading.Event):
        self.command = command
        self.cluster = cluster
        self.output = output
        self.grace_seconds = grace_seconds
        self.processes: dict[Task, subprocess.Popen] = {}
        self.relays: list[threading.Thread] = []
        self.write_lock = threading.Lock()
        self.interrupted = interrupted  # Set by SIGINT or SIGTERM to the launcher.
        # The coordinator (chief) decides when there are servers; else every worker.
        self.chief_decides = "ps" in cluster
        self.deciders = ([Task("chief", 0)] if self.chief_decides else
                         [Task("worker", i) for i in range(len(cluster["worker"]))])
        self.reported: set[Task] = set()

    def run(self) -> int:
        try:
            self._start()
            return self._watch()
        finally:
            self._stop_all()
            for relay in self.relays:
                relay.join(timeout=2)

    def _start(self) -> None:
        for task_type, addresses in self.cluster.items():
            for index in range(len(addresses)):
                task = Task(task_type, index)
                tf_config = {"cluster": self.cluster,
                             "task": {"type": task_type, "index": index}}
                process = subprocess.Popen(
                    self.command, env=child_environment({"TF_CONFIG": json.dumps(tf_config)}),
                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                    text=True, bufsize=1, errors="replace", start_new_session=True)
                self.processes[task] = process
                relay = threading.Thread(target=self._relay, args=(task, process), daemon=True)
                relay.start()
                self.relays.append(relay)

    def _relay(self, task: Task, process: subprocess.Popen) -> None:
        for line in process.stdout:
            with self.write_lock:
                self.output.write(f"[{task.name}] {line}" if line.endswith("\n")
                                  else f"[{task.name}] {line}\n")
                self.output.flush()

    def _watch(self) -> int:
        while True:
            if self.interrupted.is_set():
                _say(self.output, "interrupted; stopping every task")
                return 130
            for task, process in self.processes.items():
                status = process.poll()
                if status is None or status == 0 or task in self.reported:
                    continue
                if self.chief_decides and task not in self.deciders:
                    self.reported.add(task)
                    _say(self.output, f"{task.name} exited with status {status}; the chief "
                                      f"decides whether training goes on")
                    continue
                _say(self.output, f"{task.name} exited with status {status}; "
                                  f"stopping the other tasks")
                return status if status > 0 else 1
            if all(self.processes[task].poll() == 0 for task in self.deciders):
                return 0
            self.interrupted.wait(0.1)

    def _stop_all(self) -> None:
        running = [p for p in self.processes.values() if p.poll() is None]
        for process in running:
            _signal_group(process, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_seconds
        for process in running:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
        for process in self.processes.values():
            # The leader may be gone while its group lives on: signal the group regardless.
            _signal_group(process, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=self.grace_seconds)


def _signal_group(process: subprocess.Popen, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signum)


@contextlib.contextmanager
def _signals_set(event: threading.Event) -> Iterator[None]:
    """SIGINT and SIGTERM to the launcher set `event`, which stops the group.

    The handler only sets a flag: an exception raised wherever the signal lands
    could fall between starting a child and recording it, and leave it running.
    SIGINT is handled explicitly too: a process started in the background by a
    non-interactive shell inherits SIGINT as ignored, and Python then installs no
    Ctrl-C handler of its own.
    """
    previous = {}
    try:
        for signum in (signal.SIGINT, signal.SIGTERM):
            previous[signum] = signal.signal(signum, lambda *_: event.set())
    except ValueError:  # Not the main thread: leave signals alone.
        pass
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
