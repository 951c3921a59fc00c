"""The Keras fixes: detected from Keras's own code, applied once, undone cleanly.

That each one is needed is shown with real workers in tests/adapters/test_multi_worker.py.
"""

import pytest

from tfdist import keras_compat


@pytest.fixture
def keras_as_installed():
    keras_compat.undo_multi_worker_fixes()
    yield
    keras_compat.undo_multi_worker_fixes()


def test_this_keras_has_both_bugs(keras_as_installed):
    assert keras_compat.symbolic_build_reduces_data()
    assert keras_compat.metric_reduction_uses_axis_0()


def test_fixes_apply_once_and_undo(keras_as_installed):
    assert keras_compat.apply_multi_worker_fixes() == ["symbolic_build", "metric_reduction"]
    assert not keras_compat.symbolic_build_reduces_data()  # the fixed code is recognised
    assert not keras_compat.metric_reduction_uses_axis_0()
    assert keras_compat.apply_multi_worker_fixes() == []
    keras_compat.undo_multi_worker_fixes()
    assert keras_compat.symbolic_build_reduces_data()
    assert keras_compat.metric_reduction_uses_axis_0()


def test_importing_tfdist_applies_nothing(tmp_path):
    import sys

    from tests.conftest import run_command

    code = ("import tfdist; from tfdist import keras_compat; "
            "print(keras_compat.symbolic_build_reduces_data())")
    result = run_command([sys.executable, "-c", code], cwd=tmp_path)
    assert result.stdout.strip() == "True", result.stderr[-2000:]
