"""The README's Python blocks run as written: each that starts with an import is a whole
program, run in a fresh process in an empty folder; the others are fragments of a program
the text around them describes, and are listed here by their first line."""

import re
import sys

import pytest

from tests.conftest import REPO, run_command

pytestmark = pytest.mark.multiprocess

FRAGMENTS = {
    "model.fit(runner.dataset(train, 256, shuffle_buffer_size=50_000), epochs=10,",
    "def train():",
}


def python_blocks():
    text = (REPO / "README.md").read_text()
    return re.findall(r"^```python\n(.*?)^```$", text, flags=re.S | re.M)


def test_every_block_is_a_program_or_a_listed_fragment():
    blocks = python_blocks()
    assert len(blocks) >= 5
    for block in blocks:
        first = block.splitlines()[0]
        assert first.startswith(("import ", "from ")) or first in FRAGMENTS, first


@pytest.mark.parametrize("block", [b for b in python_blocks()
                                   if b.startswith(("import ", "from "))],
                         ids=lambda block: block.splitlines()[0][:40])
def test_a_readme_program_runs_as_written(block, tmp_path):
    result = run_command([sys.executable, "-c", block], cwd=tmp_path, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
