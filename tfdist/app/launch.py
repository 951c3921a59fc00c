"""A local multi-process launcher: one machine runs the same code a cluster would.

`tfdist launch -n N [--ps M] [--max_restarts R] -- CMD ...` starts N workers
(and, with `--ps`, M parameter servers and a chief that coordinates them) on
free loopback ports (held by the launcher until the tasks' servers bind them),
each with its TF_CONFIG. It is a tool for tests, demos and
single-host runs, not a cluster manager.

- Every output line is prefixed with its task: `[worker:1] Epoch 1/5`. Each task
  writes to a pseudo-terminal of its own (as mpirun's ranks do), so a Keras progress
  bar is drawn in place, and stays one updating line (`tfdist.app.console`).
- Without `--ps`, the group succeeds when every worker exits 0; when one fails,
  the others are stopped (SIGTERM, then SIGKILL after a grace period) and the
  launcher exits non-zero, naming the failed task.
- With `--ps`, the chief decides, as in a real parameter-server cluster: a
  worker or parameter server that exits is reported and left to the chief
  (which reschedules a worker's steps, and stops with an error when a parameter
  server is lost); the group ends with the chief's exit status, and the servers
  still running are then stopped.
- `--max_restarts R` restarts the whole group up to R times after a failure,
  whatever the failure (a preempted group exits with status 143 after saving), and
  then ends with the status of the last failure.
- A task that exits with status 143 (`tfdist.resume.preemption.RESTART_EXIT_CODE`: every
  process saved at one agreed step) gives the others `grace_seconds` to exit by
  themselves; after any other failure they are stopped at once.
- Ctrl-C or SIGTERM to the launcher sends SIGTERM to every child, which lets tfdist's
  training save and exit within its grace period, and ends with 130 (Ctrl-C) or 143
  (SIGTERM). A child still running `grace_seconds` later is killed. Each child leads its
  own process group, which is what is signalled, so grandchildren go too: no orphans.
- Exit statuses are the shell's: a task killed by signal N ends the group with 128 + N.
- The tasks share a private network, loopback alone (`tfdist.app.isolation`), unless
  `network="host"`: TensorFlow's servers authenticate no one and listen on every
  interface, so on the machine's network anyone who reaches it could run operations in
  the tasks. Where the system allows no private network, the launch says so once, in
  one line, and runs on the machine's network.

Example:

    status = launch(["tfdist", "train", "--strategy", "multi_worker"], num_workers=2)
"""

from __future__ import annotations

import codecs
import contextlib
import dataclasses
import errno
import json
import os
import pty
import random
import shutil
import signal
import socket
import subprocess
import sys
import termios
import threading
import time
from typing import IO, Callable, Iterator, Sequence

from tfdist.app.console import Console
from tfdist.app.interruption import Interruption, interruption_handled
from tfdist.app.isolation import IsolationUnavailable, PrivateNetwork
from tfdist.cluster import child_environment, ephemeral_port_range
from tfdist.errors import ConfigError
from tfdist.quiet import is_tensorflow_log_line
from tfdist.resume.preemption import RESTART_EXIT_CODE

LOOPBACK = "127.0.0.1"
# After a failure the survivors cannot finish a step (their peer is gone), so there is
# nothing to wait for: they get this long between SIGTERM and SIGKILL.
FAILURE_GRACE_SECONDS = 5.0
_READ_BYTES = 65536


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

    The ports are free when picked, not held: a caller that starts the tasks itself
    and cannot afford a port taken meanwhile uses `reserved_cluster`.
    """
    with reserved_cluster(num_workers, num_ps, host) as cluster:
        return cluster


@contextlib.contextmanager
def reserved_cluster(num_workers: int, num_ps: int = 0,
                     host: str = LOOPBACK) -> Iterator[dict[str, list[str]]]:
    """`cluster_spec`, with its ports held until the block ends (see `reserved_ports`).

    Args:
        num_workers: Workers (>= 1).
        num_ps: Parameter servers, with a chief to coordinate them; or 0.
        host: The address the tasks listen on.

    Example:

        with reserved_cluster(2, num_ps=1) as cluster:
            ...   # start the tasks, whose servers bind cluster's ports
    """
    roles = {"chief": 1, "worker": num_workers, "ps": num_ps} if num_ps else {
        "worker": num_workers}
    with reserved_ports(sum(roles.values()), host) as ports:
        addresses = iter(f"{host}:{port}" for port in ports)
        yield {role: [next(addresses) for _ in range(count)] for role, count in roles.items()}


# Below the kernel's ephemeral range, above the ports services usually own.
_LOWEST_PORT = 20000


def free_ports(count: int, host: str = LOOPBACK) -> list[int]:
    """`count` distinct ports that nothing holds now (`reserved_ports`, released at once).

    Args:
        count: How many ports.
        host: The address they must be free on.

    Example:
        chief, worker = free_ports(2)   # e.g. [24811, 31207]
    """
    with reserved_ports(count, host) as ports:
        return ports


@contextlib.contextmanager
def reserved_ports(count: int, host: str = LOOPBACK) -> Iterator[list[int]]:
    """`count` distinct free ports, drawn at random below the kernel's ephemeral
    range and held until the block ends, while the tasks' servers bind them.

    Why below the range: the kernel's own choice (`bind(0)`) comes from the
    ephemeral range, the one it also gives every outgoing connection its local
    port from, so any gRPC channel on the machine could take the port before the
    task binds it (a parameter server then failed with "Could not start gRPC
    server", and the chief reached another cluster's task there).

    Why held: between the pick and the task's bind (seconds: the task imports
    TensorFlow first), another launcher's random draw could pick the same port.
    Each port stays bound by a socket that never listens. It was bound alone (no
    SO_REUSEADDR), so a port another launcher holds fails this one's bind and is
    skipped; SO_REUSEADDR set after the bind then lets the task's server (gRPC
    sets it too) bind and listen on the port while it is held.

    Args:
        count: How many ports.
        host: The address they must be free on.

    Raises:
        ConfigError: fewer than `count` free ports were found.

    Example:
        with reserved_ports(2) as (chief, worker):   # e.g. 24811, 31207
            ...
    """
    low, _ = ephemeral_port_range()
    draw = random.SystemRandom()
    with contextlib.ExitStack() as stack:
        ports: list[int] = []
        for _ in range(count * 50):
            if len(ports) == count:
                break
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            port = draw.randrange(_LOWEST_PORT, low) if low > _LOWEST_PORT + 1000 else 0
            try:
                sock.bind((host, port))
            except OSError:
                continue
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            ports.append(sock.getsockname()[1])
        if len(ports) < count:
            raise ConfigError(f"tfdist launch found {len(ports)} of {count} free ports on "
                              f"{host} between {_LOWEST_PORT} and {low}; free some, or run "
                              f"fewer tasks. Received: {count} tasks")
        yield ports


def launch(command: Sequence[str], num_workers: int, num_ps: int = 0, max_restarts: int = 0, *,
           grace_seconds: float = 30.0, output: IO[str] | None = None,
           hide_tensorflow_log: bool = False, network: str = "private") -> int:
    """Runs `command` once per task of a local cluster and returns the group's exit status.

    Args:
        command: The program and its arguments; every task runs the same one.
        num_workers: Worker processes (>= 1).
        num_ps: Parameter servers (with a chief to coordinate them), or 0.
        max_restarts: Restarts of the whole group after a failure.
        grace_seconds: How long children have to save and exit after the launcher
            is interrupted, or after a task exits with status 143, before SIGKILL.
        output: Where prefixed lines go. None: standard output.
        hide_tensorflow_log: Drop the tasks' TensorFlow C++ log lines at INFO and
            WARNING severity (those written while TensorFlow loads get past
            `TF_CPP_MIN_LOG_LEVEL`).
        network: "private": the tasks share a network namespace with loopback alone,
            reachable from them alone (a new one for each attempt); "host": the
            machine's network.

    Returns:
        0 on success; otherwise the failed task's exit status (128 + N for a task
        killed by signal N), or 130 after Ctrl-C and 143 after SIGTERM to the
        launcher.

    Raises:
        ConfigError: bad counts, or an empty command or one that is not found.
    """
    if not command:
        raise ConfigError("tfdist launch needs a command after '--', such as "
                          "tfdist launch -n 2 -- tfdist train --strategy multi_worker")
    for name, value, lowest in (("-n", num_workers, 1), ("--ps", num_ps, 0),
                                ("--max_restarts", max_restarts, 0)):
        if value < lowest:
            raise ConfigError(f"tfdist launch {name} must be an integer >= {lowest}. "
                              f"Received: {name} {value}")
    if network not in ("private", "host"):
        raise ConfigError(f"tfdist launch --network must be private or host. "
                          f"Received: --network {network}")
    if shutil.which(command[0]) is None:
        raise ConfigError(f"tfdist launch: command not found: {command[0]}; give a program on "
                          f"PATH or a path to an executable file. Received: "
                          f"{' '.join(command)}")
    output = sys.stdout if output is None else output
    status = 1
    with interruption_handled() as interrupted:
        for attempt in range(max_restarts + 1):
            if attempt:
                _say(output, f"restarting the group (restart {attempt} of {max_restarts})")
            with reserved_cluster(num_workers, num_ps) as cluster, \
                    _network(network, output, warned=attempt > 0) as run_in_network:
                status = _Group(run_in_network(list(command)), cluster, output, grace_seconds,
                                interrupted, hide_tensorflow_log).run()
            if status == 0 or interrupted.is_set():
                return status
    return status


def _say(output: IO[str], message: str) -> None:
    print(f"tfdist launch: {message}", file=output, flush=True)


@contextlib.contextmanager
def _network(network: str, output: IO[str],
             warned: bool) -> Iterator[Callable[[list[str]], list[str]]]:
    """Yields what makes a task's command line run in the launch's network."""
    if network == "host":
        yield lambda command: command
        return
    private = PrivateNetwork()
    try:
        private.start()
    except IsolationUnavailable as reason:
        if not warned:
            _say(output, f"the tasks' TensorFlow servers listen on every interface of this "
                         f"machine and run whatever any caller sends: {reason}. Allow user "
                         f"namespaces (or run with CAP_SYS_ADMIN), keep their ports behind a "
                         f"firewall, or pass --network host to accept this and silence it")
        yield lambda command: command
        return
    try:
        yield private.command
    finally:
        private.stop()


class _Group:
    """One attempt: start every task, relay output, watch, stop."""

    def __init__(self, command: list[str], cluster: dict[str, list[str]], output: IO[str],
                 grace_seconds: float, interrupted: Interruption,
                 hide_tensorflow_log: bool = False):
        self.command = command
        self.cluster = cluster
        self.output = output
        self.grace_seconds = grace_seconds
        self.processes: dict[Task, subprocess.Popen] = {}
        self.relays: list[threading.Thread] = []
        self.console = Console(output, keep_line=(lambda line: not is_tensorflow_log_line(line))
                               if hide_tensorflow_log else None)
        self.interrupted = interrupted  # Set by SIGINT or SIGTERM to the launcher.
        # The coordinator (chief) decides when there are servers; else every worker.
        self.chief_decides = "ps" in cluster
        self.deciders = ([Task("chief", 0)] if self.chief_decides else
                         [Task("worker", i) for i in range(len(cluster["worker"]))])
        self.reported: set[Task] = set()

    def run(self) -> int:
        # Until a task fails, children are stopped with the long grace (an interrupt lets
        # them save); `_watch` shortens it after a failure that leaves nothing to save.
        self.stop_grace = self.grace_seconds
        try:
            self._start()
            return self._watch()
        finally:
            self._stop_all(self.stop_grace)
            for relay in self.relays:
                relay.join(timeout=2)

    def _start(self) -> None:
        for task_type, addresses in self.cluster.items():
            for index in range(len(addresses)):
                task = Task(task_type, index)
                tf_config = {"cluster": self.cluster,
                             "task": {"type": task_type, "index": index}}
                # A terminal for the task's output, as mpirun gives its ranks: Keras then
                # draws its progress bar in place ("\r") instead of a line per refresh.
                terminal, task_side = pty.openpty()
                _no_output_processing(task_side)
                try:
                    process = subprocess.Popen(
                        self.command,
                        env=child_environment({"TF_CONFIG": json.dumps(tf_config)}),
                        stdin=subprocess.DEVNULL, stdout=task_side, stderr=task_side,
                        start_new_session=True)
                except BaseException:
                    os.close(terminal)
                    raise
                finally:
                    os.close(task_side)
                self.processes[task] = process
                relay = threading.Thread(target=self._relay, args=(task, terminal), daemon=True)
                relay.start()
                self.relays.append(relay)

    def _say(self, message: str) -> None:
        self.console.say(f"tfdist launch: {message}")

    def _relay(self, task: Task, terminal: int) -> None:
        stream = self.console.stream(task.name)
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        try:
            # Chunks as they come, not lines: a progress bar's "\r" updates end in none.
            while chunk := _read_terminal(terminal):
                stream.feed(decoder.decode(chunk))
            stream.feed(decoder.decode(b"", final=True))
            stream.close()
        finally:
            os.close(terminal)

    def _watch(self) -> int:
        while True:
            if self.interrupted.is_set():
                self._say("interrupted; stopping every task")
                return 128 + self.interrupted.signum
            for task, process in self.processes.items():
                status = process.poll()
                if status is None or status == 0 or task in self.reported:
                    continue
                status = _shell_status(status)
                if self.chief_decides and task not in self.deciders:
                    self.reported.add(task)
                    self._say(f"{task.name} exited with status {status}; the chief "
                              f"decides whether training goes on")
                    continue
                if status == RESTART_EXIT_CODE:
                    self._say(f"{task.name} exited with status {status} (saved for a "
                              f"restart); waiting up to {self.grace_seconds:g} s for "
                              f"the other tasks")
                    self._wait_for_all(self.grace_seconds)
                else:
                    self._say(f"{task.name} exited with status {status}; "
                              f"stopping the other tasks")
                    self.stop_grace = FAILURE_GRACE_SECONDS
                return status
            if all(self.processes[task].poll() == 0 for task in self.deciders):
                return 0
            self.interrupted.wait(0.1)

    def _wait_for_all(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        for process in self.processes.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=max(0.0, deadline - time.monotonic()))

    def _stop_all(self, grace_seconds: float) -> None:
        running = [p for p in self.processes.values() if p.poll() is None]
        for process in running:
            _signal_group(process, signal.SIGTERM)
        deadline = time.monotonic() + grace_seconds
        for process in running:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
        for process in self.processes.values():
            # The leader may be gone while its group lives on: signal the group regardless.
            _signal_group(process, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=FAILURE_GRACE_SECONDS)


def _no_output_processing(terminal: int) -> None:
    """The task's bytes as it wrote them: no "\n" turned into "\r\n" by the terminal."""
    attributes = termios.tcgetattr(terminal)
    attributes[1] &= ~termios.OPOST  # the output flags
    termios.tcsetattr(terminal, termios.TCSANOW, attributes)


def _read_terminal(terminal: int) -> bytes:
    """The next chunk a task wrote; b"" once every writer has closed its side."""
    try:
        return os.read(terminal, _READ_BYTES)
    except OSError as error:  # Linux says EIO, not end of file, when the last writer closes.
        if error.errno == errno.EIO:
            return b""
        raise


def _shell_status(returncode: int) -> int:
    """A child's exit status as a shell reports it: 128 + N when signal N ended it."""
    return 128 - returncode if returncode < 0 else returncode


def _signal_group(process: subprocess.Popen, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signum)
