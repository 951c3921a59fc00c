"""Counts the Python processes the tests start (`tests/conftest.py` puts this folder on
PYTHONPATH, so every interpreter a test starts imports this module at start-up).

Only where `TFDIST_TEST_COSTS` names a file: at its exit, a process appends one JSON line
there, with the test that started it (pytest's `PYTEST_CURRENT_TEST`, which children
inherit) and whether it had imported TensorFlow. A process killed by SIGKILL writes
nothing, so the count is a floor. The end-of-run cost summary reads the lines.

Where `COVERAGE_PROCESS_START` names coverage.py's config (`make refusals`), it also starts
coverage.py in the process.
"""

import os

if os.environ.get("TFDIST_TEST_COSTS"):
    import atexit

    def _record(path=os.environ["TFDIST_TEST_COSTS"],
                test=os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0]):
        import json
        import sys

        line = json.dumps({"process": os.getpid(), "test": test,
                           "tensorflow": "tensorflow" in sys.modules}) + "\n"
        # One short append per process: lines from processes exiting together stay whole.
        descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(descriptor, line.encode())
        finally:
            os.close(descriptor)

    atexit.register(_record)

# `make refusals`: coverage.py in every process the tests start, as `coverage run` is in the
# test process (the config is the file COVERAGE_PROCESS_START names; tests/refusals.py).
if os.environ.get("COVERAGE_PROCESS_START"):
    try:
        import coverage
    except ImportError:  # an interpreter outside .venv (a test's other Python)
        pass
    else:
        coverage.process_startup()
