"""benchmarks/method.py: how figures summarise samples and meet targets."""

import json
import statistics
import sys

import pytest

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
from method import emit, figure, interleaved, median_interval  # noqa: E402


def test_a_figure_is_the_median_with_its_spread_and_verdict():
    ratio = figure("ratio", "A / B", [1.03, 0.99, 1.00, 1.02, 0.98], target="<= 1.01")
    assert (ratio.median, ratio.low, ratio.high, ratio.samples) == (1.00, 0.98, 1.03, 5)
    assert ratio.met is True
    assert figure("speedup", "A / B", [1.2, 1.3], target=">= 1.4").met is False
    assert figure("rate", "A", [5.0], unit="GB/s").met is None
    with pytest.raises(ValueError, match="no samples"):
        figure("empty", "A", [])


def test_the_bootstrap_interval_brackets_the_median_and_narrows_with_samples():
    rng = __import__("numpy").random.default_rng(1)
    few = list(1.0 + 0.02 * rng.standard_normal(8))
    many = list(1.0 + 0.02 * rng.standard_normal(200))
    low, high = median_interval(few)
    assert low <= statistics.median(few) <= high
    many_low, many_high = median_interval(many)
    assert many_high - many_low < high - low
    assert median_interval(few) == (low, high)  # seeded: a report reproduces


def test_interleaved_alternates_and_leaves_out_the_warm_up():
    calls = []
    seconds = interleaved({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")},
                          repeats=3, warmup=2)
    assert calls == ["a", "b"] * 5
    assert [len(seconds["a"]), len(seconds["b"])] == [3, 3]


def test_interleaved_runs_the_barrier_untimed_before_every_call():
    calls = []
    seconds = interleaved({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")},
                          repeats=2, warmup=1, before=lambda: (calls.append("|"),
                                                               __import__("time").sleep(0.05)))
    assert calls == ["|", "a", "|", "b"] * 3
    assert max(seconds["a"] + seconds["b"]) < 0.05  # the barrier's time is not the call's


def test_emit_prints_one_json_line_with_each_median(capsys):
    emit("demo", [figure("ratio", "A / B", [1.0, 2.0, 3.0], target="<= 2.5")], rounds=3)
    line = json.loads(capsys.readouterr().out)
    assert line["benchmark"] == "demo" and line["rounds"] == 3 and line["ratio"] == 2.0
    assert line["figures"][0]["met"] is True
    with pytest.raises(ValueError, match="repeat"):
        emit("demo", [figure("x", "", [1]), figure("x", "", [2])])
