"""A private network for the tasks of a one-machine launch: reachable from the tasks alone.

TensorFlow's gRPC servers run whatever any caller sends, without authentication
(TensorFlow's SECURITY.md), and they listen on every interface of the machine, whatever
host TF_CONFIG names. `tfdist launch` therefore starts its tasks in a network namespace
of their own, with only a loopback interface: they reach each other at 127.0.0.1, and
nothing outside reaches them.

- A holder process makes the namespace (`unshare`: as root, a network namespace; else a
  user namespace that maps this user to itself, and a network namespace in it), brings
  its loopback up, and keeps it alive until the launch ends.
- Each task joins it (`setns`) just before its command runs: the task's command line is
  `python isolation.py join PID -- COMMAND...`, which then becomes COMMAND (`execvp`).
- Where the system allows neither (a container without the capability, a distribution
  that restricts unprivileged user namespaces), `PrivateNetwork.start` raises
  `IsolationUnavailable` with the reason, and the launch says so in one line.

This module uses the standard library alone, and runs by its path (`python -I FILE`), so
joining costs a task a few tens of milliseconds, not an import of TensorFlow.

Example:

    with PrivateNetwork() as network:
        subprocess.run(network.command(["tfdist", "train", "--strategy", "multi_worker"]))
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import socket
import struct
import subprocess
import sys
from typing import Sequence

# <sched.h>, <linux/sockios.h>, <net/if.h>
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
SIOCGIFFLAGS = 0x8913
SIOCSIFFLAGS = 0x8914
IFF_UP = 0x1
_READY = "ready"
_START_BOUND_SECONDS = 30.0  # a hang bound: the holder needs well under a second


class IsolationUnavailable(OSError):
    """This system lets the launch make no private network; the message says why."""


class PrivateNetwork:
    """A network namespace with loopback alone, held for as long as the block runs.

    Example:

        with PrivateNetwork() as network:
            network.command(["python", "train.py"])   # joins it, then runs train.py
    """

    def __init__(self) -> None:
        self._holder: subprocess.Popen | None = None

    def __enter__(self) -> "PrivateNetwork":
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> None:
        """Makes the namespace.

        Raises:
            IsolationUnavailable: the system allows no namespace here (the reason).
        """
        self._holder = subprocess.Popen([sys.executable, "-I", os.path.abspath(__file__), "hold"],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True)
        try:
            said = self._holder.stdout.readline().strip()
        except BaseException:
            self.stop()
            raise
        if said != _READY:
            self.stop()
            raise IsolationUnavailable(said or "the namespace's holder ended without a word")

    @property
    def pid(self) -> int:
        """The holder's process id: /proc/PID/ns/net is the namespace."""
        if self._holder is None:
            raise RuntimeError("the private network is not started")
        return self._holder.pid

    def command(self, command: Sequence[str]) -> list[str]:
        """`command`, run inside the namespace."""
        return [sys.executable, "-I", os.path.abspath(__file__), "join", str(self.pid), "--",
                *command]

    def stop(self) -> None:
        """Ends the holder; the namespace goes with the last process in it."""
        holder, self._holder = self._holder, None
        if holder is None:
            return
        if holder.stdin:
            holder.stdin.close()  # the holder waits on its standard input
        try:
            holder.wait(timeout=_START_BOUND_SECONDS)
        except subprocess.TimeoutExpired:
            holder.kill()
            holder.wait()
        if holder.stdout:
            holder.stdout.close()


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _call(name: str, *arguments: int) -> None:
    if getattr(_libc(), name)(*arguments) != 0:
        number = ctypes.get_errno()
        raise OSError(number, f"{name}: {os.strerror(number)}")


def _bring_loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sh", b"lo", 0)
        flags = struct.unpack("16sh", fcntl.ioctl(sock, SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(sock, SIOCSIFFLAGS, struct.pack("16sh", b"lo", flags | IFF_UP))


def _write(path: str, text: str) -> None:
    with open(path, "w") as file:
        file.write(text)


def enter_private_network() -> None:
    """Moves this process into a new network namespace with its loopback up.

    As root, a network namespace; otherwise a user namespace of its own, where this
    user maps to itself and holds the capability to make (and configure) a network
    namespace. The process must have one thread (a user namespace needs it).

    Raises:
        IsolationUnavailable: the system allows neither (the reason).

    Example:

        enter_private_network()
        os.execvp("mpirun", ["mpirun", "-np", "2", "python", "train.py"])
    """
    try:
        try:
            _call("unshare", CLONE_NEWNET)  # needs CAP_SYS_ADMIN: root, most often
        except OSError as error:
            if error.errno != errno.EPERM:
                raise
            uid, gid = os.getuid(), os.getgid()
            _call("unshare", CLONE_NEWUSER | CLONE_NEWNET)
            _write("/proc/self/uid_map", f"{uid} {uid} 1")
            _write("/proc/self/setgroups", "deny")
            _write("/proc/self/gid_map", f"{gid} {gid} 1")
        _bring_loopback_up()
    except OSError as error:
        raise IsolationUnavailable(f"no private network namespace could be made here "
                                   f"({error.strerror or error})") from None


def _hold() -> int:
    """Makes the namespace, says "ready" (or why not), and waits for standard input to close."""
    try:
        enter_private_network()
    except IsolationUnavailable as reason:
        print(reason, flush=True)
        return 1
    print(_READY, flush=True)
    sys.stdin.read()
    return 0


def _join(pid: int, command: list[str]) -> None:
    """Enters the holder's namespaces (its user namespace first, where it has one of its
    own), then becomes `command`."""
    for kind, flag in (("user", CLONE_NEWUSER), ("net", CLONE_NEWNET)):
        target = f"/proc/{pid}/ns/{kind}"
        if os.stat(target).st_ino == os.stat(f"/proc/self/ns/{kind}").st_ino:
            continue  # already there (a root holder keeps the user namespace)
        descriptor = os.open(target, os.O_RDONLY)
        try:
            _call("setns", descriptor, flag)
        finally:
            os.close(descriptor)
    os.execvp(command[0], command)


def main(argv: list[str]) -> int:
    if argv[1:2] == ["hold"]:
        return _hold()
    if argv[1:2] == ["join"] and len(argv) > 4 and argv[3] == "--":
        _join(int(argv[2]), argv[4:])
    print("usage: isolation.py hold | join PID -- COMMAND...", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
