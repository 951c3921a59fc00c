"""SIGINT and SIGTERM to a process that starts others (`tfdist launch`, `tfdist supervise`).

Such a process must not die where the signal lands: it has children to stop in
order. `interruption_handled` turns both signals into an event its loop reads.

Example:

    with interruption_handled() as interrupted:
        while child.poll() is None and not interrupted.is_set():
            interrupted.wait(0.1)
    status = 128 + interrupted.signum if interrupted.is_set() else child.returncode
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator


class Interruption(threading.Event):
    """Set by SIGINT or SIGTERM; remembers which (`signum`)."""

    signum = signal.SIGINT

    def set_by(self, signum: int) -> None:
        self.signum = signum
        self.set()


@contextlib.contextmanager
def interruption_handled() -> Iterator[Interruption]:
    """SIGINT and SIGTERM set the `Interruption` this yields, until the block ends.

    The handler only sets a flag: an exception raised wherever the signal lands
    could fall between starting a child and recording it, and leave it running.
    SIGINT is handled explicitly too: a process started in the background by a
    non-interactive shell inherits SIGINT as ignored, and Python then installs no
    Ctrl-C handler of its own. Off the main thread, signals are left alone.
    """
    event = Interruption()
    previous = {}
    try:
        for signum in (signal.SIGINT, signal.SIGTERM):
            previous[signum] = signal.signal(signum, lambda received, _: event.set_by(received))
    except ValueError:  # Not the main thread: leave signals alone.
        pass
    try:
        yield event
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
