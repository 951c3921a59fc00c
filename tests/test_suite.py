"""The suite's own machinery: what `make test` and `make test-all` rely on: tests side by
side, and the tiers."""

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
    # `make test-all` keeps a module whose tests share one launch (a module-scoped fixture)
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


TIER_CONFTEST = '''
import pytest

from tests.tiers import listed_id

LISTED = {f"test_grouped.py::test_writes_its_worker[{index}]" for index in (1, 4)}


def pytest_collection_modifyitems(items):
    for item in items:
        if listed_id(item) in LISTED:
            item.add_marker(pytest.mark.first_tier)
'''


@pytest.mark.multiprocess
def test_the_first_tier_is_marked_in_a_group_under_xdist(tmp_path):
    # make test selects `-m first_tier` with --dist loadgroup, where pytest-xdist's workers
    # rename a grouped module's tests (`...[1]@one_worker`): the listed ones still run.
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    first_tier: listed\n")
    (tmp_path / "conftest.py").write_text(TIER_CONFTEST)
    (tmp_path / "test_grouped.py").write_text(GROUPED_MODULE)
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist",
                             "loadgroup", "-p", "no:cacheprovider", "-m", "first_tier",
                             f"--basetemp={tmp_path / 'base'}", "test_grouped.py"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-2000:]
    assert sorted(path.name for path in (tmp_path / "base").glob("worker-*.txt")) == [
        "worker-1.txt", "worker-4.txt"]


def test_every_strategy_and_technique_has_a_first_tier_test():
    from tests.tiers import FIRST_TIER, NO_FIRST_TIER_RUN, TECHNIQUES
    from tfdist import registry

    required = {*registry.available(), *TECHNIQUES} - set(NO_FIRST_TIER_RUN)
    assert required <= set(FIRST_TIER), f"no first-tier test for {required - set(FIRST_TIER)}"
    assert all(FIRST_TIER.values())


@pytest.mark.multiprocess
def test_make_test_selects_the_unit_tier_and_exactly_the_first_tier_listed():
    # The expression the Makefile gives pytest, collected here: the tests it selects beyond
    # the unit tier are exactly tests/tiers.py's (each one exists, under that node id).
    from tests.conftest import REPO
    from tests.tiers import first_tier_tests

    def makefile(variable):
        return subprocess.run(["make", "-s", "--no-print-directory", "--eval",
                               f"print-{variable}: ; @echo '$({variable})'",
                               f"print-{variable}"], cwd=REPO, capture_output=True,
                              text=True, check=True).stdout.strip()

    first_tier, unit_tier = makefile("FIRST_TIER"), makefile("UNIT_TIER")
    assert "first_tier" in first_tier and unit_tier in first_tier
    result = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                             "-p", "no:cacheprovider", "-m", f"({first_tier}) and not "
                             f"({unit_tier})"], cwd=REPO, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    selected = {line for line in result.stdout.splitlines() if "::" in line}
    assert selected == first_tier_tests(), (selected ^ first_tier_tests())
