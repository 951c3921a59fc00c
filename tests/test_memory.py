"""Memory from TensorFlow's own allocator (tfdist/memory.py), and `tfdist train`'s report of it.

The allocator counts on a CPU only when TF_CPU_ALLOCATOR_USE_BFC=true is set before
TensorFlow starts, so the counting cases run in processes of their own; this process
(set up without it) shows the plain CPU's answer, None.
"""

import json
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.conftest import TFDIST, last_json_line, run_command
from tfdist.cluster import cpu_allocator_counts
from tfdist.memory import AllocatorBytes, PeakMemory, allocator_bytes, counted_devices

MIB = 2**20
BFC = {"TF_CPU_ALLOCATOR_USE_BFC": "true"}

# Before fit, 64 MiB alive then freed; during fit, a 4 MiB kernel and its gradient (SGD).
PEAKS = """
import json
import keras, numpy as np, tensorflow as tf
from tfdist.memory import PeakMemory, allocator_bytes
before = tf.ones((64 * 2**20 // 4,))
del before
model = keras.Sequential([keras.Input((1024,)), keras.layers.Dense(1024, use_bias=False)])
model.compile(keras.optimizers.SGD(0.1), "mse")
peak = PeakMemory()
x = np.zeros((32, 1024), "float32")
model.fit(x, x, batch_size=32, epochs=1, verbose=0, callbacks=[peak])
print(json.dumps({"peak": peak.to_dict(), "now": allocator_bytes("CPU:0").current}))
"""


def test_a_plain_cpu_keeps_no_figures_and_the_callback_says_none():
    assert counted_devices() == ["CPU:0"]  # both logical CPU devices share the host's allocator
    assert allocator_bytes("CPU:0") is None
    peak = PeakMemory()
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    model.fit(np.zeros((4, 2)), np.zeros((4, 1)), verbose=0, callbacks=[peak])
    assert peak.bytes is None and peak.to_dict() is None


def test_a_plain_cpu_allocator_that_answers_zeros_still_keeps_no_figures(monkeypatch):
    # TensorFlow 2.21 on an AMD EPYC answers {'current': 0, 'peak': 0} for the plain CPU
    # allocator where an Intel CPU raises: the variable decides, not the answer.
    def zeros(device):
        return {"current": 0, "peak": 0}

    monkeypatch.setattr(tf.config.experimental, "get_memory_info", zeros)
    monkeypatch.delenv("TF_CPU_ALLOCATOR_USE_BFC", raising=False)
    assert allocator_bytes("CPU:0") is None
    peak = PeakMemory()
    peak.on_train_begin()
    peak.on_train_end()
    assert peak.to_dict() is None
    # With the BFC allocator on, the same answer is its figures (here: the fake's zeros).
    monkeypatch.setenv("TF_CPU_ALLOCATOR_USE_BFC", "TRUE")
    assert allocator_bytes("CPU:0") == AllocatorBytes(current=0, peak=0)
    monkeypatch.setenv("TF_CPU_ALLOCATOR_USE_BFC", "0")
    assert allocator_bytes("CPU:0") is None


@pytest.mark.parametrize("value, counts", [("true", True), ("1", True), ("True", True),
                                           ("false", False), ("0", False), ("", False),
                                           ("yes", False)])
def test_the_bfc_variable_is_read_as_tensorflow_reads_it(value, counts):
    assert cpu_allocator_counts({"TF_CPU_ALLOCATOR_USE_BFC": value}) is counts
    assert cpu_allocator_counts({}) is False


@pytest.mark.multiprocess
def test_the_peak_over_the_process_keeps_what_was_freed_before_fit_and_fits_own_does_not(
        tmp_path):
    result = run_command([sys.executable, "-c", PEAKS], cwd=tmp_path, env=BFC)
    assert result.returncode == 0, result.stderr[-3000:]
    figures = last_json_line(result.stdout)
    peak = figures["peak"]["CPU:0"]
    assert peak["process"] >= 64 * MIB  # the tensor freed before fit
    assert 8 * MIB <= peak["fit"] < 64 * MIB  # the kernel and its gradient, alive at once
    assert figures["now"] >= 4 * MIB  # the kernel lives on


@pytest.mark.multiprocess
def test_tfdist_train_reports_its_allocator_peak_where_the_allocator_counts(tmp_path):
    reports = {}
    for name, env in (("bfc", BFC), ("plain", {})):
        result = run_command([TFDIST, "train", "--strategy", "one_device", "--set",
                              "train.epochs=1", "--set", f"train.output_dir={tmp_path / name}"],
                             cwd=tmp_path, env=env)
        assert result.returncode == 0, result.stderr[-3000:]
        reports[name] = last_json_line(result.stdout)
        saved = json.loads((tmp_path / name / "result.json").read_text())
        assert saved["allocator_peak_bytes"] == reports[name]["allocator_peak_bytes"]
    peak = reports["bfc"]["allocator_peak_bytes"]["CPU:0"]
    assert peak["process"] >= peak["fit"] >= reports["bfc"]["optimizer_state_bytes"] > 0
    assert reports["plain"]["allocator_peak_bytes"] is None
