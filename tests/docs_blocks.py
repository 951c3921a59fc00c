"""The README's and the docs pages' code blocks, read and run as a reader runs them.

Blocks are read with markdown-it-py, the CommonMark parser that Keras already brings (through
rich), so a fence inside a list item is found as a reader's renderer finds it. The tools
built for this (Sybil, pytest-markdown-docs) run a block inside the test's own process; a
page's programs must each start fresh instead (environment variables set before TensorFlow
starts, two processes under a launcher), so only the parsing is taken from a library.

What a page may hold:

- a `python` block that starts with an import: a whole program. One that does not continues
  the page's last whole program and runs joined to it, the earlier blocks first;
- a `sh` block: commands, each line run by bash in order (a `\\` at a line's end joins the
  next; `#` starts a comment). Lines that install into an environment (`pip install`) run in
  a fresh environment in `tests/test_packaging.py`; `make test` and the other test targets
  (`test*`, `lint`, `docs`) are what CI runs itself, and `make bench`, `make mutants` and
  `make refusals` (10 minutes to an hour each) are run before a release:
  `tests/test_benchmarks.py` runs each benchmark briefly, `tests/test_mutants.py` checks that
  each deliberate bug still applies, `tests/test_refusals.py` how refusals are judged;
- a `yaml` block: a config `tfdist.load_config` reads; a `text` block: output or a listing;
- an HTML comment right before a block, with clauses separated by `;`:
  `under: LAUNCHER` (the python block runs as `LAUNCHER python program.py`),
  `prints: A | B` (output lines equal to A, then B), `writes: PATH, PATH` (there after),
  `accuracy above: X` (the last accuracy Keras or a result line shows), `loss below: X`
  (the last loss Keras shows),
  `needs: a cluster` (or a GPU, a TPU: not run here).

A page's blocks run in order in one folder holding a copy of the repository's files
(`examples/keras_fit.py` is there, as in a clone), with the environment's `bin` first on
PATH. Every run is checked beyond its exit status: where Keras's progress shows losses, the
last is below the first (a model that learns); a result line's `accuracy` is above chance;
and the page's `prints` and `writes`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from markdown_it import MarkdownIt

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
NEEDS = ("a cluster", "a GPU", "a TPU")
# `make` targets that CI runs itself (.ci/run runs `make test-all`, which runs lint and docs).
TEST_TARGETS = re.compile(r"^make (test\S*|lint|docs)\b")
BEFORE_A_RELEASE = re.compile(r"^make (bench|mutants|refusals)\b")
INSTALLS = re.compile(r"\bpip install\b")
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
LOSS = re.compile(r"(?<![\w.])loss: ([0-9.]+(?:e[-+]?\d+)?)")
ACCURACY = re.compile(r"(?<![\w.])\"?accuracy\"?: ([0-9.]+)")


@dataclasses.dataclass(frozen=True)
class Block:
    """One fenced block: where it is, its language, its text, and the clauses of the HTML
    comment right before it."""

    page: str
    line: int
    lang: str
    body: str
    marks: tuple[tuple[str, str], ...] = ()

    def mark(self, name: str) -> str | None:
        return dict(self.marks).get(name)

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def is_program(self) -> bool:
        return self.body.startswith(("import ", "from "))

    @property
    def runs_here(self) -> bool:
        return self.mark("needs") is None and self.lang in ("python", "sh")


def parse_marks(comment: str) -> tuple[tuple[str, str], ...]:
    """`<!-- under: X; prints: Y -->` as (("under", "X"), ("prints", "Y"))."""
    text = comment.strip().removeprefix("<!--").removesuffix("-->").strip()
    marks = []
    for clause in filter(None, (part.strip() for part in text.split(";"))):
        name, _, value = clause.partition(":")
        marks.append((name.strip(), value.strip()))
    return tuple(marks)


def page_blocks(page: Path) -> list[Block]:
    tokens = MarkdownIt("commonmark").parse(page.read_text())
    found = []
    for index, token in enumerate(tokens):
        if token.type != "fence":
            continue
        before = tokens[index - 1] if index else None
        marks = (parse_marks(before.content) if before is not None
                 and before.type == "html_block" and before.content.startswith("<!--") else ())
        name = page.relative_to(REPO).as_posix() if page.is_relative_to(REPO) else page.name
        found.append(Block(name, token.map[0] + 1,
                           token.info.strip(), token.content, marks))
    return found


def all_blocks() -> list[Block]:
    return [block for page in PAGES for block in page_blocks(page)]


def shell_lines(body: str) -> list[str]:
    """A sh block's commands: continuation lines joined, comments and blank lines left out."""
    lines, pending = [], ""
    for raw in body.splitlines():
        line = pending + raw
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        pending = ""
        command = re.sub(r"(^|\s)#.*$", "", line).strip()
        if command:
            lines.append(command)
    return lines


def not_run_here(line: str) -> str | None:
    """Why a documented command is run elsewhere than by its page's test, or None."""
    if TEST_TARGETS.match(line):
        return "a test target: CI runs `make test-all` (.ci/run)"
    if BEFORE_A_RELEASE.match(line):
        return ("run before a release (10 minutes to an hour each): tests/test_benchmarks.py "
                "runs each benchmark, tests/test_mutants.py checks each bug still applies, "
                "tests/test_refusals.py checks how refusals are found and judged")
    return None


def runs_in_its_page(block: Block) -> bool:
    """Whether the page's test runs (some of) this block."""
    if not block.runs_here or installs(block):
        return False
    return block.lang == "python" or any(not_run_here(line) is None
                                         for line in shell_lines(block.body))


def installs(block: Block) -> bool:
    """Whether a sh block installs into an environment: tests/test_packaging.py runs such a
    block whole, in a fresh environment, not the page's test."""
    return block.lang == "sh" and any(INSTALLS.search(line) for line in shell_lines(block.body))


@dataclasses.dataclass
class Run:
    """One command a page's test ran, and what it printed."""

    what: str
    command: str
    returncode: int
    output: str
    unmet: list[str] = dataclasses.field(default_factory=list)  # the page's prints, writes

    def problems(self) -> list[str]:
        """What is wrong with this run, judged as a reader would: it failed, its model did
        not learn, or its result is at chance."""
        text = ANSI.sub("", self.output)
        found = []
        if self.returncode != 0:
            found.append(f"exit status {self.returncode}:\n{text[-3000:]}")
            return [f"{self.what}: `{self.command}`: {problem}" for problem in found]
        found += self.unmet
        losses = [float(value) for value in LOSS.findall(text)]
        if len(losses) >= 2 and not losses[-1] < losses[0]:
            found.append(f"the loss did not fall: {losses[0]} at first, {losses[-1]} at last")
        if any(not math.isfinite(loss) for loss in losses):
            found.append(f"a loss is not finite: {losses}")
        result = result_line(text)
        if result is not None and result.get("accuracy") is not None:
            if not result["accuracy"] > 0.5:
                found.append(f"held-out accuracy {result['accuracy']} (10 classes): at chance")
        return [f"{self.what}: `{self.command}`: {problem}" for problem in found]


def result_line(text: str) -> dict | None:
    """The last line that is a JSON object (tfdist train's result, a task's prefix removed)."""
    for line in reversed(text.splitlines()):
        line = re.sub(r"^\[[\w:]+\] ", "", line.strip())
        if line.startswith("{") and line.endswith("}"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                return None
    return None


def copy_of_repository(folder: Path) -> Path:
    """The repository's own files (what a clone holds) copied into `folder`, with times
    kept (so `make` finds the environment set up), and the environment linked."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True,
                            check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = REPO / name
        if source.is_file():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, folder / name)
    venv = REPO / ".venv"
    if venv.exists():
        (folder / ".venv").symlink_to(venv)
    return folder


def run_page(page: Path, folder: Path, *, timeout: float = 420) -> list[Run]:
    """Runs every block of the page at `page` that this machine runs, in order, in `folder`
    (a copy of the repository)."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}"
           f"{os.environ.get('PATH', '')}", "TF_CPP_MIN_LOG_LEVEL": "2"}
    runs, program = [], ""
    for block in page_blocks(page):
        if not runs_in_its_page(block):
            continue
        if block.lang == "python":
            program = block.body if block.is_program else program + "\n" + block.body
            path = folder / "program.py"
            path.write_text(program)
            launcher = block.mark("under")
            command = f"{launcher} python program.py" if launcher else "python program.py"
            runs.append(_run(block, command, folder, env, timeout))
        else:
            for line in shell_lines(block.body):
                if not_run_here(line) is None:
                    runs.append(_run(block, line, folder, env, timeout))
        _check_marks(block, runs[-1] if runs else None, folder)
    return runs


def _run(block: Block, command: str, folder: Path, env: dict, timeout: float) -> Run:
    done = subprocess.run(["bash", "-o", "pipefail", "-c", command], cwd=folder, env=env,
                          stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)
    return Run(block.where, command, done.returncode, done.stdout)


def _check_marks(block: Block, run: Run | None, folder: Path) -> None:
    """Adds to the block's last run what its `prints` and `writes` promised and it did not."""
    if run is None or run.returncode != 0:
        return
    lines = [line.strip() for line in ANSI.sub("", run.output).splitlines()]
    position = 0
    for text in filter(None, (part.strip() for part in (block.mark("prints") or "").split("|"))):
        if text not in lines[position:]:
            run.unmet.append(f"no line {text!r} printed (after the ones before it)")
            break
        position = lines.index(text, position) + 1
    for name in filter(None, (part.strip() for part in (block.mark("writes") or "").split(","))):
        if not (folder / name).exists():
            run.unmet.append(f"{name} not written")
    if block.mark("loss below") is not None:
        losses = [float(value) for value in LOSS.findall(ANSI.sub("", run.output))]
        if not losses or not losses[-1] < float(block.mark("loss below")):
            run.unmet.append(f"loss {losses[-1:] or 'never shown'}, not below "
                             f"{block.mark('loss below')}")
    if block.mark("accuracy above") is not None:
        reached = [float(value) for value in ACCURACY.findall(ANSI.sub("", run.output))]
        if not reached or not reached[-1] > float(block.mark("accuracy above")):
            run.unmet.append(f"accuracy {reached[-1:] or 'never shown'}, not above "
                             f"{block.mark('accuracy above')}")
