"""How a benchmark starts the processes it measures and reads back what they measured.

A benchmark that needs several processes (2 workers under `tfdist launch`, 2 ranks
under `mpirun`) or a fresh one (a strategy made once per process) runs itself again
as a child with `--output=FILE`; the child that reports (the chief, rank 0) writes
one JSON object to FILE. Reading that file, rather than the launcher's stdout where
the processes' lines interleave, is what keeps the parent from parsing half a line.

    from processes import mpirun, run_children, write_report

    figures = run_children([*mpirun(2), sys.executable, __file__, "--role=rank"],
                           what="horovod ranks")       # the child calls write_report(...)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

# A benchmark has 5 minutes in all. The suite's smoke runs (tests/test_benchmarks.py) give
# their children the test's own hang bound instead: on 2 cores beside the suite's other
# tests, custom_loop.py's two ranks tracing MobileNetV2 (49 s alone) passed 280 s.
TIMEOUT_SECONDS = float(os.environ.get("BENCHMARK_CHILD_TIMEOUT_SECONDS", 280))


def mpirun(ranks: int) -> list[str]:
    """The command prefix that starts `ranks` local Open MPI ranks.

    Args:
        ranks: -np; more ranks than cores are allowed (--oversubscribe).

    Raises:
        SystemExit: Open MPI's mpirun is not on PATH.
    """
    path = shutil.which("mpirun")
    if path is None:
        raise SystemExit("mpirun not found: install Open MPI (apt-get install openmpi-bin)")
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []  # Open MPI refuses root unasked
    return [path, *root, "--oversubscribe", "-np", str(ranks)]


def tfdist_launch(workers: int, parameter_servers: int = 0) -> list[str]:
    """The command prefix that starts a local cluster with `tfdist launch`.

    Args:
        workers: -n.
        parameter_servers: --ps (0: none, and no coordinator).
    """
    command = [os.path.join(os.path.dirname(sys.executable), "tfdist"), "launch",
               "-n", str(workers)]
    if parameter_servers:
        command += ["--ps", str(parameter_servers)]
    return [*command, "--"]


def write_report(path: str | None, payload: object) -> None:
    """In a child: writes what it measured to the file its parent passed (`--output`).

    Written to a temporary name and renamed, so the parent never reads half a file.
    Without a path (the script run by hand, as compute.py is on a GPU machine) the
    JSON is printed instead.

    Args:
        path: The `--output` value, or None.
        payload: Anything `json.dump` takes.
    """
    if not path:
        print(json.dumps(payload), flush=True)
        return
    folder = os.path.dirname(os.path.abspath(path))
    with tempfile.NamedTemporaryFile("w", dir=folder, delete=False, suffix=".tmp") as stream:
        json.dump(payload, stream)
    os.replace(stream.name, path)


def run_children(command: list[str], what: str, timeout: float = TIMEOUT_SECONDS,
                 echo: bool = False) -> object:
    """Runs `command` plus `--output=FILE`; returns the JSON its reporting child wrote.

    Args:
        command: The launcher prefix (if any) and the child's command line.
        what: Names the run in the error ("the 2-worker cluster").
        timeout: Seconds before the run is stopped and reported as failed.
        echo: Print the children's stdout (a benchmark whose children print tables).

    Returns:
        The JSON object the child passed to `write_report`.

    Raises:
        SystemExit: The run failed, timed out, or wrote no report; with its output's tail.
    """
    with tempfile.TemporaryDirectory(prefix="tfdist-bench-") as folder:
        report = os.path.join(folder, "report.json")
        try:
            result = subprocess.run([*command, f"--output={report}"], capture_output=True,
                                    text=True, stdin=subprocess.DEVNULL, timeout=timeout,
                                    env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
        except subprocess.TimeoutExpired:
            raise SystemExit(f"{what} did not finish in {timeout:.0f} s") from None
        if echo:
            print(result.stdout, end="", flush=True)
        if result.returncode or not os.path.exists(report):
            raise SystemExit(f"{what} failed (exit status {result.returncode}):\n"
                             f"{(result.stdout + result.stderr)[-3000:]}")
        with open(report) as stream:
            return json.load(stream)
