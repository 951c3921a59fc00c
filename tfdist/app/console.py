"""Several tasks' output on one console, each line prefixed with its task (`tfdist launch`).

A task's whole lines are written as `[worker:0] line`. A line a task rewrites in place,
as Keras's progress bar does (`\\r`, with backspaces, and no newline until the epoch
ends), stays one updating line: `\\r[worker:0] 13/32 [====>...]`, the way `horovodrun`
shows it, rather than one line per refresh. When another task writes meanwhile, the
updating line is ended where it stands, and the other task's line goes below it.

Example:

    console = Console(sys.stdout)
    stream = console.stream("worker:0")
    stream.feed("\\r1/3")     # [worker:0] 1/3
    stream.feed("\\r2/3")     # \\r[worker:0] 2/3
    stream.feed("\\r3/3\\n")   # \\r[worker:0] 3/3 and a newline
"""

from __future__ import annotations

import re
import threading
from typing import IO, Callable

# A line ends at "\n" ("\r\n" included), or is rewritten from its start after "\r".
_END = re.compile(r"\r\n|\n|\r")


class Console:
    """The shared output; remembers which task's line is being updated in place.

    Args:
        output: Where the prefixed text goes.
        keep_line: Which whole lines to write (None: all), such as one that drops
            TensorFlow's log lines.
    """

    def __init__(self, output: IO[str], keep_line: Callable[[str], bool] | None = None):
        self.output = output
        self.keep_line = keep_line
        self._lock = threading.Lock()
        self._updating: str | None = None  # The task whose line is on screen, unended.

    def stream(self, task: str) -> "TaskStream":
        """The input side for one task's output."""
        return TaskStream(self, task)

    def say(self, line: str) -> None:
        """Writes one line of the launcher's own, unprefixed, below any updating line."""
        with self._lock:
            self.output.write(("\n" if self._updating else "") + f"{line}\n")
            self._updating = None
            self.output.flush()

    def write_line(self, task: str, line: str) -> None:
        if self.keep_line is not None and not self.keep_line(line):
            return
        with self._lock:
            if self._updating == task:
                self.output.write(f"\r[{task}] {line}\n")
            else:
                self.output.write(("\n" if self._updating else "") + f"[{task}] {line}\n")
            self._updating = None
            self.output.flush()

    def update_line(self, task: str, text: str) -> None:
        with self._lock:
            if self._updating == task:
                self.output.write(f"\r[{task}] {text}")
            else:
                self.output.write(("\n" if self._updating else "") + f"[{task}] {text}")
            self._updating = task
            self.output.flush()


class TaskStream:
    """Assembles one task's text, chunk by chunk, into whole lines and in-place updates."""

    def __init__(self, console: Console, task: str):
        self.console = console
        self.task = task
        self._pending = ""  # The line being written, since the last "\r" or "\n".
        self._shown = ""  # What of it is on screen as an update.
        # Whether the line is drawn in place (a "\r" came since the last "\n"). Only
        # such a line is shown before its end: an ordinary line read in two chunks is
        # written once, whole.
        self._in_place = False
        self._held_return = False  # A chunk ended in "\r": it may be half of "\r\n".

    def feed(self, text: str) -> None:
        """Takes the next chunk of the task's output (any split, in order)."""
        if self._held_return:
            text, self._held_return = "\r" + text, False
        if text.endswith("\r"):
            text, self._held_return = text[:-1], True
        # Backspaces erase what a progress bar wrote before; "\r" rewrites it here.
        text = text.replace("\b", "")
        start = 0
        for end in _END.finditer(text):
            self._pending += text[start:end.start()]
            if end.group() == "\r":
                self._pending = self._shown = ""  # Rewritten from its start.
                self._in_place = True
            else:
                self.console.write_line(self.task, self._pending)
                self._pending = self._shown = ""
                self._in_place = False
            start = end.end()
        self._pending += text[start:]
        if self._in_place and self._pending and self._pending != self._shown:
            self.console.update_line(self.task, self._pending)
            self._shown = self._pending

    def close(self) -> None:
        """The task's output ended: a last line without a newline is written whole."""
        if self._pending:
            self.console.write_line(self.task, self._pending)
        self._pending = self._shown = ""
        self._in_place = False
