"""Shared test set-up: two logical CPU devices, clean Keras state, subprocess helpers, and
the markers' skips.

Markers (setup.cfg): `multiprocess` (starts processes), `slow` (trains for seconds in this
process), `benchmark` (runs a benchmark), `gpu`, `requires_mpi`, `requires_horovod`.
`make test-fast` runs the rest: the unit tier. A test that needs what is missing here
(a GPU, mpirun, Horovod) is skipped with the reason, unless `--require-all` (which
`make test` and `make test-all` pass) turns a missing mpirun or Horovod into a failure.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import keras
import pytest
import tensorflow as tf

from tfdist.devices import split_cpu

REPO = Path(__file__).resolve().parents[1]
TFDIST = str(Path(sys.executable).with_name("tfdist"))


def pytest_configure(config):
    # TensorFlow fixes its devices when its runtime starts. Splitting the CPU
    # before any test runs lets one_device and 2-replica mirrored tests share a
    # process in any order.
    split_cpu(2)
    # `make test-all` runs several tests at once on 2 cores, so ranks often wait for a core.
    # A waiting Open MPI rank polls without yielding by default, taking the core its
    # peer needs: 3 Horovod tests side by side took 23.6 s each, and 17.4 s yielding
    # (tests/adapters/test_horovod.py's fp16 test, 3 copies at once). Every process the
    # tests start inherits this.
    os.environ.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
    # Ranks waiting for each other in a collective (an ordering deadlock) fail a test in
    # under a minute, not at its timeout: Horovod names the tensors each rank is missing
    # after 10 s, and shuts down after 40 s (a rank tracing its first step on a loaded
    # machine can lag its peer by several seconds, which must not fail a test).
    os.environ.setdefault("HOROVOD_STALL_CHECK_TIME_SECONDS", "10")
    os.environ.setdefault("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "40")
    # Every process the tests start (the `tfdist` command, scripts, ranks, from any folder)
    # imports the tree under test, not whatever tree the environment's editable install
    # names: a copy of the repository (`make mutants`) tests its own code.
    # tests/process_count (its sitecustomize) counts those processes for the cost summary.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(REPO), str(REPO / "tests" / "process_count"),
         *filter(None, [os.environ.get("PYTHONPATH")])])
    if not hasattr(config, "workerinput"):
        # The run's report: each test's line and each started process's line (its workers,
        # started after this, inherit the variable). A pytest that a test starts is a run of
        # its own, with a report of its own.
        report = config.getoption("--cpu-report")
        if not report:
            import tempfile

            descriptor, report = tempfile.mkstemp(prefix="tfdist-test-costs-", suffix=".jsonl")
            os.close(descriptor)
            config.add_cleanup(lambda: os.remove(report))
        os.environ["TFDIST_TEST_COSTS"] = os.path.abspath(report)


def pytest_report_header(config):
    return (f"tensorflow {tf.__version__}, keras {keras.__version__} from "
            f"{Path(keras.__file__).parent}")


def pytest_addoption(parser):
    parser.addoption("--require-all", action="store_true",
                     help="fail, rather than skip, tests whose mpirun or Horovod is missing")
    parser.addoption("--cpu-report", metavar="FILE",
                     help="append each test's CPU seconds (its own process and every process "
                          "it started and waited for), wall seconds, start time and xdist "
                          "worker to FILE, one JSON line per test, and a line for each Python "
                          "process a test started; the run's cost summary reads all of FILE "
                          "(make test-all appends its two parts to one; tests/costs.py)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    import resource

    def cpu() -> float:
        return sum(usage.ru_utime + usage.ru_stime for usage in (
            resource.getrusage(resource.RUSAGE_SELF),
            resource.getrusage(resource.RUSAGE_CHILDREN)))

    cpu_before, wall_before, started = cpu(), time.monotonic(), time.time()
    yield
    # The worker and the start time show the run's schedule: a worker idle at the end
    # while another runs a long group is time the order could save.
    line = {"test": item.nodeid, "cpu_s": round(cpu() - cpu_before, 2),
            "wall_s": round(time.monotonic() - wall_before, 2), "started": round(started, 1),
            "worker": os.environ.get("PYTEST_XDIST_WORKER", "main")}
    with open(os.environ["TFDIST_TEST_COSTS"], "a") as stream:  # One short write per line:
        stream.write(json.dumps(line) + "\n")                  # workers do not interleave.


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter, config):
    # Last, after the slowest tests: what the run spent, where a CPU-bound suite's time
    # goes (the controller's report holds its workers' lines too).
    if hasattr(config, "workerinput"):
        return
    from tests.costs import render, summarize

    with open(os.environ["TFDIST_TEST_COSTS"]) as stream:
        summary = summarize(stream)
    if summary["tests"]:
        terminalreporter.write_sep("=", "cost")
        for line in render(summary):
            terminalreporter.write_line(line)


def _missing() -> dict[str, str]:
    """Marker -> why its tests cannot run here (only for what is missing)."""
    missing = {}
    if not tf.config.list_physical_devices("GPU"):
        missing["gpu"] = "needs a GPU; none found"
    if shutil.which("mpirun") is None:
        missing["requires_mpi"] = "needs Open MPI's mpirun on PATH (apt install openmpi-bin)"
    if importlib.util.find_spec("horovod") is None:
        missing["requires_horovod"] = ("needs Horovod (scripts/install_horovod.sh; make setup "
                                       "runs it)")
    return missing


def pytest_collection_modifyitems(config, items):
    # Under pytest-xdist (`make test`) the longest work starts first: the modules that run
    # on one worker as a group (test_backup's ~10 minutes is the suite's longest chain),
    # then the other modules that start processes, while the many short in-process tests
    # fill the workers' last minutes. Each module stays in one piece, in its own order: a
    # module-scoped fixture (a run several tests read) is torn down as soon as the next
    # test is from another module.
    def rank(module: str) -> int:
        if module in grouped:
            return 0
        return 1 if module in starts_processes else 2

    grouped = {item.module.__name__ for item in items if "xdist_group" in item.keywords}
    starts_processes = {item.module.__name__ for item in items
                        if "multiprocess" in item.keywords or "benchmark" in item.keywords}
    items.sort(key=lambda item: rank(item.module.__name__))
    from tests.tiers import first_tier_tests, listed_id

    first_tier = first_tier_tests()
    missing = _missing()
    for item in items:
        if listed_id(item) in first_tier:
            item.add_marker(pytest.mark.first_tier)
        for marker, reason in missing.items():
            if marker not in item.keywords:
                continue
            if marker != "gpu" and config.getoption("--require-all"):
                raise pytest.UsageError(f"--require-all: {item.nodeid} {reason}")
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session", autouse=True)
def worker_tmpdir():
    """Each pytest worker's processes get a temporary folder of their own (TMPDIR).

    Module-scoped fixtures start processes before `private_tmpdir` applies, so without
    this two workers' `mpirun`s share /tmp and race to create Open MPI's session folder
    there ("mkdir /tmp/ompi.HOST.0: File exists").
    """
    import tempfile

    folder = tempfile.mkdtemp(prefix="tfdist-worker-")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TMPDIR", folder)
        yield Path(folder)
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(autouse=True)
def private_tmpdir(monkeypatch):
    """Each test's processes get a temporary folder of their own (TMPDIR).

    Tests run side by side: Open MPI's session folders, Keras's and tfdist's scratch
    folders and anything a test counts there stay apart. Short (Open MPI puts Unix
    sockets there, whose paths have a 108-byte limit); removed after the test.
    """
    import tempfile

    folder = tempfile.mkdtemp(prefix="tfdist-test-")
    monkeypatch.setenv("TMPDIR", folder)
    yield Path(folder)
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(autouse=True)
def clean_keras_state():
    """Each test starts and ends with Keras's default dtype policy and a fresh session."""
    # Without Keras's gc.collect (0.1-0.3 s a call here, twice a test); Python's own
    # collector still runs.
    policy = keras.config.dtype_policy()
    keras.backend.clear_session(free_memory=False)
    yield
    keras.config.set_dtype_policy(policy)
    keras.backend.clear_session(free_memory=False)


def mpirun(*args: str, processes: int = 2) -> list[str]:
    """The `mpirun` command line for `processes` local ranks running `args`."""
    # Open MPI refuses to start as root unless told; containers and CI often are root.
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    return [shutil.which("mpirun") or "mpirun", *root, "--oversubscribe", "-np", str(processes),
            *args]


def horovodrun(*args: str, processes: int = 2, hosts: str | None = None) -> list[str]:
    """The `horovodrun --gloo` command line for `processes` ranks running `args`: all on
    localhost, or spread as `hosts` says (`"localhost:1,127.0.0.1:1"`: two host names for
    this machine, one rank each)."""
    return [str(Path(sys.executable).with_name("horovodrun")), "--gloo", "-np", str(processes),
            "-H", hosts or f"localhost:{processes}", *args]


def launcher_command(launcher: str, *args: str, processes: int = 2) -> list[str]:
    """`mpirun(...)` or `horovodrun(...)`, by name."""
    return (mpirun if launcher == "mpirun" else horovodrun)(*args, processes=processes)


def run_command(args: list[str], *, cwd: Path, env: dict[str, str] | None = None,
                timeout: float = 120) -> subprocess.CompletedProcess:
    """Runs a command with this interpreter's environment (plus `env`; a None value
    unsets a variable), capturing text."""
    merged = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})}
    full_env = {name: value for name, value in merged.items() if value is not None}
    return subprocess.run(args, cwd=cwd, env=full_env, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def last_json_line(stdout: str) -> dict:
    """The JSON object on the last non-empty line of a command's output."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    assert lines, "the command printed nothing"
    return json.loads(lines[-1])
