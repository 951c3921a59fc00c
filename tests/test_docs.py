"""The README's and the docs site's code blocks run as written (tests/docs_blocks.py has the
rules): every page's blocks, in order, in a copy of the repository, each run checked for
what the page says it prints, writes or trains to. A block changed to be wrong fails.

The site itself is built with `mkdocs build --strict` by `make test`; a broken link fails it
(shown here on a copy with one).
"""

import shutil
import sys

import pytest

from tests.conftest import REPO, run_command
from tests.docs_blocks import (NEEDS, PAGES, all_blocks, copy_of_repository, page_blocks,
                               run_page, runs_in_its_page)

CLAUSES = {"under", "prints", "writes", "accuracy above", "loss below", "needs"}
RUN_PAGES = [page for page in PAGES if any(map(runs_in_its_page, page_blocks(page)))]


def test_every_block_runs_here_or_needs_what_this_machine_lacks():
    assert len(all_blocks()) >= 30
    wrong = []
    for block in all_blocks():
        first = block.body.splitlines()[0] if block.body else ""
        unknown = {name for name, _ in block.marks} - CLAUSES
        if unknown:
            wrong.append(f"{block.where}: unknown clauses {sorted(unknown)} before {first!r}")
        if block.mark("needs") is not None and block.mark("needs") not in NEEDS:
            wrong.append(f"{block.where}: needs {block.mark('needs')!r}: not one of {NEEDS}")
        if block.lang not in ("python", "sh", "yaml", "text"):
            wrong.append(f"{block.where}: a ```{block.lang} block: neither run nor read")
    assert wrong == []


def test_a_continuing_block_joins_its_pages_last_program():
    # The first python block of every page is a whole program, so a continuing one always
    # has one to join.
    for page in PAGES:
        python = [block for block in page_blocks(page) if block.lang == "python"]
        assert not python or python[0].is_program, python[0].where


@pytest.mark.parametrize("body", [pytest.param(block.body, id=block.where)
                                  for block in all_blocks() if block.lang == "yaml"])
def test_a_yaml_block_is_a_config_tfdist_reads(body, tmp_path):
    from tfdist import load_config

    path = tmp_path / "config.yaml"
    path.write_text(body)
    load_config(str(path))


@pytest.mark.multiprocess
@pytest.mark.parametrize("page", [pytest.param(page, id=page.relative_to(REPO).as_posix())
                                  for page in RUN_PAGES])
def test_a_page_runs_as_written(page, tmp_path):
    runs = run_page(page, copy_of_repository(tmp_path))
    assert runs
    assert [problem for run in runs for problem in run.problems()] == []


@pytest.mark.multiprocess
def test_a_page_with_a_wrong_block_fails(tmp_path):
    # The README's program, twice made wrong: an import left out, and logits given to a loss
    # that expects probabilities (it runs, and its loss even falls, but it learns nothing).
    (program,) = [block.body for block in page_blocks(REPO / "README.md")
                  if block.lang == "python" and "runner.dataset" in block.body]
    mark = "<!-- accuracy above: 0.95; loss below: 0.1 -->\n"
    missing_import = program.replace("import keras, numpy as np,", "import keras,", 1)
    logits = program.replace('Dense(2, activation="softmax")', "Dense(2)", 1)
    assert missing_import != program and logits != program
    page = tmp_path / "wrong.md"
    page.write_text(f"{mark}```python\n{missing_import}```\n\n{mark}```python\n{logits}```\n")
    first, second = run_page(page, copy_of_repository(tmp_path / "repo"))
    assert "NameError: name 'np' is not defined" in first.problems()[0]
    assert second.returncode == 0 and "not below 0.1" in " ".join(second.problems())


@pytest.mark.multiprocess
def test_a_broken_link_fails_the_strict_build(tmp_path):
    # The same site with one link to a page that is not there.
    shutil.copytree(REPO / "docs", tmp_path / "docs")
    shutil.copy(REPO / "mkdocs.yml", tmp_path / "mkdocs.yml")
    # The build's hooks read the benchmarks (their docstrings, RESULTS.md, its plots).
    shutil.copytree(REPO / "benchmarks", tmp_path / "benchmarks")
    choosing = tmp_path / "docs" / "guide" / "choosing.md"
    choosing.write_text(choosing.read_text() + "\nSee [the old page](no-such-page.md).\n")
    mkdocs = [sys.executable, "-m", "mkdocs", "build", "--strict",
              "--site-dir", str(tmp_path / "site")]
    result = run_command(mkdocs, cwd=tmp_path, timeout=300, env={"NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode != 0
    assert "no-such-page.md" in result.stdout + result.stderr
