"""The suite's own machinery: what `make test` relies on to run tests side by side."""

import subprocess
import sys

import pytest

GROUPED_MODULE = '''
import os
import pytest

pytestmark = pytest.mark.xdist_group("one_worker")

@pytest.mark.parametrize("index", range(6))
def test_writes_its_worker(index, tmp_path_factory):
    folder = tmp_path_factory.getbasetemp().parent
    (folder / f"worker-{index}.txt").write_text(os.environ["PYTEST_XDIST_WORKER"])
'''


@pytest.mark.multiprocess
def test_loadgroup_runs_a_modules_group_on_one_worker(tmp_path):
    # `make test` keeps a module whose tests share one launch (a module-scoped fixture)
    # on one worker with pytest.mark.xdist_group. pytest 9.2 with pytest-xdist 3.8 spreads
    # them silently (pytest-dev/pytest-xdist#1386); pyproject.toml keeps pytest below it.
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_grouped.py").write_text(GROUPED_MODULE)
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "3", "--dist",
                             "loadgroup", "-p", "no:cacheprovider",
                             f"--basetemp={tmp_path / 'base'}", "test_grouped.py"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-2000:]
    written = list((tmp_path / "base").glob("worker-*.txt"))
    workers = {path.read_text() for path in written}
    assert len(written) == 6
    assert len(workers) == 1, f"the group ran on {sorted(workers)}"
