"""Start-up: reach every other task of the cluster, within a bound, before TensorFlow does.

TensorFlow's multi-worker start-up (`MultiWorkerMirroredStrategy`'s constructor) blocks
in C++ until every task has registered, holding Python's global lock and with its own
SIGTERM handler in place: a worker that never starts (a typo in TF_CONFIG, a pod not yet
scheduled) leaves the others silent for as long as the job is allowed to run, deaf to
SIGTERM and Ctrl-C (users meet it as tensorflow/tensorflow#46931 and #57372, closed
without a fix). So tfdist first meets its peers itself, in Python: each task listens
on its own address and connects to every other task's, until all have answered or
`cluster.startup_timeout_seconds` have passed. Only then does TensorFlow start, with
every peer known to be up. Meanwhile SIGTERM and Ctrl-C end the process as usual.

The rest of a process's start, before TensorFlow's runtime, is here too: its thread
pools (`configure_threads`: several local processes deadlock with too few inter-op
threads) and the warning that TensorFlow's servers authenticate no one
(`warn_if_untrusted_network`).

Example:

    wait_for_peers("127.0.0.1:2222", {"worker:1": "127.0.0.1:2223"}, timeout_seconds=300)
"""

from __future__ import annotations

import contextlib
import errno
import socket
import threading
import time
from typing import Iterator, Mapping

from absl import logging

from tfdist.cluster import beyond_loopback
from tfdist.config import ThreadsConfig
from tfdist.errors import ClusterError, ConfigError

# How often an absent peer is tried again, and how long one try may take.
_RETRY_SECONDS = 0.25
_CONNECT_SECONDS = 1.0


def wait_for_peers(own_address: str, peers: Mapping[str, str], timeout_seconds: float, *,
                   listen: bool = True) -> None:
    """Returns once every peer accepted a connection; raises after `timeout_seconds`.

    Args:
        own_address: This task's `host:port` from the cluster spec. Its port is
            listened on (any interface) while this waits, so the peers find this task
            too; TensorFlow's server binds it afterwards.
        peers: Each other task's name ("worker:1") to its `host:port`.
        timeout_seconds: The bound on the whole wait.
        listen: False for a task nobody waits for (a parameter-server chief).

    Raises:
        ClusterError: a peer never answered within the bound (the message names every
            such task and its address), or this task's port is taken.
    """
    if not peers:
        return
    deadline = time.monotonic() + timeout_seconds
    waiting = dict(peers)
    with _listening(own_address) if listen else contextlib.nullcontext():
        logged = False
        while waiting:
            for name, address in list(waiting.items()):
                if _answers(address):
                    del waiting[name]
            if not waiting:
                break
            if time.monotonic() >= deadline:
                names = ", ".join(f"{name} ({address})" for name, address in waiting.items())
                raise ClusterError(
                    f"start-up: {names} never answered within cluster.startup_timeout_seconds="
                    f"{timeout_seconds:g}; check that every task is running and that "
                    f"TF_CONFIG (or multi_worker.workers) names it at that address, or raise "
                    f"the bound. Received: {len(waiting)} of {len(peers)} peers absent")
            if not logged:
                logging.info("tfdist: waiting up to %gs for %s", timeout_seconds,
                             ", ".join(waiting))
                logged = True
            time.sleep(_RETRY_SECONDS)


def _answers(address: str) -> bool:
    host, port = _split(address)
    try:
        with socket.create_connection((host, port), timeout=_CONNECT_SECONDS):
            return True
    except OSError:
        return False


@contextlib.contextmanager
def _listening(address: str) -> Iterator[None]:
    """Accepts (and at once closes) connections on `address`'s port while the block runs."""
    _, port = _split(address)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # TensorFlow's server binds the port right after; SO_REUSEADDR on both sides.
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind(("", port))
    except OSError as error:
        listener.close()
        if error.errno != errno.EADDRINUSE:
            raise
        raise ClusterError(f"start-up: port {port} of this task ({address}) is in use by "
                           f"another program; free it, or give this task another port in "
                           f"TF_CONFIG. Received: {error.strerror}") from None
    listener.listen(16)
    listener.settimeout(_RETRY_SECONDS)
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                connection, _ = listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            connection.close()

    thread = threading.Thread(target=accept, name="tfdist-startup-listener", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        listener.close()


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


# --- the process itself, before TensorFlow starts ----------------------------------------


_warned_untrusted = False


def warn_if_untrusted_network(addresses: list[str], trusted: bool) -> None:
    """Warns once, before any server starts, that TensorFlow's gRPC servers take anyone's calls.

    TensorFlow's distributed runtime authenticates no one: a process that can reach
    a server's port can run any operation in it (TensorFlow's SECURITY.md). A
    cluster whose addresses all lead back to this machine is the one case left
    alone: TensorFlow listens on every interface even then, and `tfdist launch` keeps
    its tasks in a network of their own (`tfdist.app.isolation`), or says in one line
    that it could not.

    Args:
        addresses: Every task's host:port in the cluster.
        trusted: The config's `trusted_network`: the user vouches for the network.

    Example:

        warn_if_untrusted_network(["10.0.0.7:2222"], trusted=False)   # warns, once
    """
    global _warned_untrusted
    exposed = beyond_loopback(addresses)
    if not exposed or trusted or _warned_untrusted:
        return
    _warned_untrusted = True
    logging.warning("tfdist: this cluster's TensorFlow servers talk over %s, and TensorFlow's "
                    "gRPC servers run whatever any caller sends, without authentication (see "
                    "TensorFlow's SECURITY.md). Run only on a network that admits trusted "
                    "machines alone, and then set trusted_network: true to silence this "
                    "warning.", ", ".join(exposed[:4]) + (", ..." if len(exposed) > 4 else ""))


def configure_threads(threads: ThreadsConfig, default_inter_op: int = 0,
                      default_intra_op: int = 0) -> None:
    """Sets TensorFlow's thread pools, which are fixed once its runtime starts.

    Args:
        threads: The config's thread counts (0: leave to the adapter, then TensorFlow).
        default_inter_op: The adapter's inter-op count when the config sets none.
        default_intra_op: The adapter's intra-op count when the config sets none.

    Raises:
        ConfigError: a count the config sets, with TensorFlow's runtime started already.

    Example:

        configure_threads(config.threads, default_inter_op=3)   # 2 processes + 1
    """
    import tensorflow as tf

    pools = tf.config.threading
    settings = (
        ("inter_op", threads.inter_op, default_inter_op, pools.get_inter_op_parallelism_threads,
         pools.set_inter_op_parallelism_threads,
         ", and several processes on one machine can deadlock with fewer"),
        ("intra_op", threads.intra_op, default_intra_op, pools.get_intra_op_parallelism_threads,
         pools.set_intra_op_parallelism_threads, ""))
    for name, count, default, getter, setter, why in settings:
        if count:
            try:
                setter(count)
            except RuntimeError:
                raise ConfigError(f"threads.{name}={count} cannot be applied: TensorFlow's "
                                  f"runtime has already started; create the Runner before any "
                                  f"TensorFlow op runs. Received: threads.{name}={count}") from None
        elif default:
            try:
                setter(max(getter(), default))
            except RuntimeError:
                logging.warning("tfdist: TensorFlow started before the Runner, so its %s "
                                "threads stay at TensorFlow's default; this strategy wants %d%s. "
                                "Create the Runner before any TensorFlow op, or set threads.%s.",
                                name.replace("_", "-"), default, why, name)
