"""Keeping TensorFlow's C++ log off the console: `tfdist train | launch | env`, and scripts.

`TF_CPP_MIN_LOG_LEVEL=2` hides TensorFlow's INFO and WARNING lines, except those its
libraries write while they load (the oneDNN notice, through absl's logging before
`absl::InitializeLog`): those are caught on file descriptor 2 while TensorFlow is
imported. Any other line written meanwhile (an import error) is passed on.

A script calls `start_quietly()` before it imports TensorFlow; a level the user set
(`TF_CPP_MIN_LOG_LEVEL=0` to see everything) is left alone, and so is every line it
lets through.

Example:

    import tfdist.quiet
    tfdist.quiet.start_quietly()           # first, before TensorFlow is imported
    import tensorflow as tf

    tfdist.quiet.is_tensorflow_log_line("I0000 00:00:17.6 700 port.cc:153] oneDNN ...")  # True
"""

from __future__ import annotations

import os
import re
import sys
import tempfile

from tfdist.cluster import set_default_environment

# TensorFlow's C++ log below ERROR: INFO and WARNING lines at start-up and in input
# pipelines.
QUIET_TENSORFLOW = {"TF_CPP_MIN_LOG_LEVEL": "2"}

# absl's C++ log prefix at INFO or WARNING severity (`I0000 00:00:1795.600453  700
# port.cc:153] ...`), and the notice absl writes before its first early line.
_TENSORFLOW_LOG_LINE = re.compile(
    r"^(?:[IW]\d{4} \d\d:\d\d:\d+\.\d+\s+\d+ [\w.-]+:\d+\] |WARNING: All log messages "
    r"before absl::InitializeLog\(\) is called are written to STDERR)")


def is_tensorflow_log_line(line: str) -> bool:
    """Whether `line` is a TensorFlow C++ log line at INFO or WARNING severity."""
    return bool(_TENSORFLOW_LOG_LINE.match(line))


def start_quietly() -> None:
    """Imports TensorFlow and Keras with their C++ INFO and WARNING lines hidden.

    Unless `TF_CPP_MIN_LOG_LEVEL` is set already (then it is the user's choice). Call it
    before anything imports TensorFlow: the level is read once, as TensorFlow loads.
    """
    if "tensorflow" in sys.modules:
        return
    if set_default_environment(QUIET_TENSORFLOW):
        import_tensorflow()


def import_tensorflow() -> None:
    """Imports TensorFlow and Keras, dropping the C++ log lines they write as they load."""
    if "tensorflow" in sys.modules:
        return
    sys.stderr.flush()
    with tempfile.TemporaryFile(mode="w+b") as captured:
        saved = os.dup(2)
        os.dup2(captured.fileno(), 2)
        try:
            import keras  # noqa: F401 - imported for its side effect: loading TensorFlow
            import tensorflow  # noqa: F401
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            for line in captured.read().decode(errors="replace").splitlines(keepends=True):
                if not is_tensorflow_log_line(line):
                    sys.stderr.write(line)
            sys.stderr.flush()
