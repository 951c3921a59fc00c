"""The README's and the docs site's code blocks, checked: each is run, parsed, or marked
with what checks it instead.

- A `python` block that starts with an import is a whole program: it runs in a fresh
  process in an empty folder.
- A `yaml` block is a config: `tfdist.load_config` reads it.
- A `text` block is output or a listing, shown as it is.
- Any other block (a fragment of a program the text around it describes, shell commands)
  follows an HTML comment saying what checks it: `<!-- fragment -->`, `<!-- checked by:
  tests/A.py, tests/B.py -->` (test files that run those commands; `.ci/run` for the make
  targets CI runs), or `<!-- needs: a cluster -->` (or a GPU, a TPU).

The site itself is built with `mkdocs build --strict` by `make test`; a broken link fails it
(shown here on a copy with one).
"""

import re
import shutil
import sys

import pytest

from tests.conftest import REPO, run_command

PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
BLOCK = re.compile(r"(?:^<!-- (?P<mark>[^>]*?) -->\n)?^```(?P<lang>\w*)\n(?P<body>.*?)^```$",
                   flags=re.S | re.M)
MARKS = re.compile(r"^(fragment|checked by: (?P<tests>[^ ].*)|needs: (a cluster|a GPU|a TPU))$")


def blocks():
    """(page, language, mark, body) of every fenced block."""
    found = []
    for page in PAGES:
        for match in BLOCK.finditer(page.read_text()):
            found.append((page.relative_to(REPO).as_posix(), match["lang"], match["mark"],
                          match["body"]))
    return found


def programs():
    seen, runnable = set(), []
    for page, lang, mark, body in blocks():
        if lang == "python" and not mark and body.startswith(("import ", "from ")):
            if body not in seen:
                seen.add(body)
                runnable.append(pytest.param(body, id=f"{page}:{body.splitlines()[0][:30]}"))
    return runnable


def test_every_block_is_run_parsed_or_marked_with_what_checks_it():
    assert len(blocks()) >= 20
    unchecked = []
    for page, lang, mark, body in blocks():
        first = body.splitlines()[0] if body else ""
        if mark:
            match = MARKS.match(mark)
            named = match["tests"].split(", ") if match and match["tests"] else []
            if not match or not all(re.fullmatch(r"tests/\S+\.py|\.ci/run", name)
                                    and (REPO / name).is_file() for name in named):
                unchecked.append(f"{page}: unknown mark <!-- {mark} --> before {first!r}")
        elif lang == "python" and first.startswith(("import ", "from ")):
            continue
        elif lang not in ("yaml", "text"):
            unchecked.append(f"{page}: ```{lang} block {first!r} is neither run nor marked")
    assert unchecked == []


@pytest.mark.parametrize("body", [pytest.param(body, id=f"{page}:{body.splitlines()[0][:30]}")
                                  for page, lang, mark, body in blocks()
                                  if lang == "yaml" and not mark])
def test_a_yaml_block_is_a_config_tfdist_reads(body, tmp_path):
    from tfdist import load_config

    path = tmp_path / "config.yaml"
    path.write_text(body)
    load_config(str(path))


@pytest.mark.multiprocess
@pytest.mark.parametrize("body", programs())
def test_a_program_runs_as_written(body, tmp_path):
    result = run_command([sys.executable, "-c", body], cwd=tmp_path, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.multiprocess
def test_a_broken_link_fails_the_strict_build(tmp_path):
    # The same site with one link to a page that is not there.
    shutil.copytree(REPO / "docs", tmp_path / "docs")
    shutil.copy(REPO / "mkdocs.yml", tmp_path / "mkdocs.yml")
    shutil.copytree(REPO / "benchmarks" / "plots", tmp_path / "benchmarks" / "plots")
    shutil.copy(REPO / "benchmarks" / "RESULTS.md", tmp_path / "benchmarks" / "RESULTS.md")
    choosing = tmp_path / "docs" / "guide" / "choosing.md"
    choosing.write_text(choosing.read_text() + "\nSee [the old page](no-such-page.md).\n")
    mkdocs = [sys.executable, "-m", "mkdocs", "build", "--strict",
              "--site-dir", str(tmp_path / "site")]
    result = run_command(mkdocs, cwd=tmp_path, timeout=300, env={"NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode != 0
    assert "no-such-page.md" in result.stdout + result.stderr
