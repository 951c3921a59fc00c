"""What a test run spent: CPU seconds per module and the processes the tests started.

A run's report is one JSON line per test (`{"test", "cpu_s", "wall_s", "started",
"worker"}`, written by `tests/conftest.py`) and one per Python process a test started
(`{"process", "test", "tensorflow"}`, written at the process's exit by
`tests/process_count/sitecustomize.py`), in one file. `make test` and `make test-all` keep
it in `.test-costs.jsonl`; `pytest --cpu-report=FILE` names another.

    python -m tests.costs .test-costs.jsonl          # the summary, as the run printed it
    python -m tests.costs .test-costs.jsonl --json --measured "make test-all at 053a8c4 ..."
                                          # docs/develop/test-costs.json: the tests page's table

Example:

    >>> summary = summarize(['{"test": "tests/a.py::t", "cpu_s": 7.5, "wall_s": 9}',
    ...                      '{"process": 1, "test": "tests/a.py::t", "tensorflow": true}'])
    >>> summary["cpu_s"], summary["processes"], summary["modules"][0]["module"]
    (7.5, 1, 'tests/a.py')
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from typing import Iterable

TOP = 10


def summarize(lines: Iterable[str]) -> dict:
    """The run's totals and each module's share, costliest first.

    Args:
        lines: the report's lines (test lines and process lines, in any order).

    Returns:
        `{"tests", "cpu_s", "processes", "tensorflow_processes", "modules": [{"module",
        "tests", "cpu_s", "share", "processes"}, ...]}`. A process started outside a test
        (pytest's own workers) is not counted.
    """
    modules = defaultdict(lambda: {"tests": 0, "cpu_s": 0.0, "processes": 0})
    processes = tensorflow_processes = 0
    for line in lines:
        if not line.strip():
            continue
        record = json.loads(line)
        module = modules[record["test"].split("::")[0]] if record["test"] else None
        if "process" in record:
            if module is not None:
                processes += 1
                tensorflow_processes += bool(record["tensorflow"])
                module["processes"] += 1
        else:
            module["tests"] += 1
            module["cpu_s"] += record["cpu_s"]
    total = sum(module["cpu_s"] for module in modules.values())
    rows = [{"module": name, "tests": module["tests"], "cpu_s": round(module["cpu_s"], 1),
             "share": round(module["cpu_s"] / total, 4) if total else 0.0,
             "processes": module["processes"]}
            for name, module in modules.items() if module["tests"]]
    rows.sort(key=lambda row: -row["cpu_s"])
    return {"tests": sum(row["tests"] for row in rows), "cpu_s": round(total, 1),
            "processes": processes, "tensorflow_processes": tensorflow_processes,
            "modules": rows}


def render(summary: dict, top: int = TOP) -> list[str]:
    """The summary as the lines the test run ends with."""
    lines = [f"{summary['cpu_s']:,.0f} CPU-s in {summary['tests']} tests; the tests started "
             f"{summary['processes']} Python processes, {summary['tensorflow_processes']} of "
             f"them with TensorFlow (a process killed by SIGKILL is not counted)",
             f"the {min(top, len(summary['modules']))} costliest modules (CPU-s: the test's "
             "process and every process it started and waited for):"]
    for row in summary["modules"][:top]:
        lines.append(f"  {row['cpu_s']:7,.0f} {row['share']:4.0%}  {row['module']} "
                     f"({row['tests']} tests, {row['processes']} processes)")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.costs", description=__doc__.split(
        "\n\n")[0])
    parser.add_argument("report", help="a run's report (.test-costs.jsonl)")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument("--measured", default="",
                        help="with --json: how the run was made (command, commit, machine)")
    args = parser.parse_args(argv)
    with open(args.report) as stream:
        summary = summarize(stream)
    if args.json:
        print(json.dumps({"measured": args.measured, **summary}, indent=1))
    else:
        print("\n".join(render(summary)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
