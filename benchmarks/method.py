"""The method every benchmark follows: interleaved timing, figures with spread, one JSON line.

Timing: the variants being compared run alternately in one process (A, B, A, B, ...),
so a slow stretch of the shared machine hits both; the first rounds are warm-up
(tracing, first rendezvous) and are left out.

A figure is one measured quantity (a ratio, a rate, a time) summarised from the
samples it was measured as: the median, the lowest and highest sample, and, for
the ratios that decide a target, a 95% bootstrap interval of the median. The
benchmark's last line of output is one JSON object holding its figures under
"figures" beside whatever details it adds; `benchmarks/report.py` reads that
line and nothing else.

    from method import emit, figure

    ratios = [tfdist / by_hand for tfdist, by_hand in zip(a, b)]  # one per round
    emit("overhead", [figure("ratio_one_device", "one_device: tfdist / by hand, step time",
                             ratios, target="<= 1.01", interval=True)],
         rounds=9)
"""

from __future__ import annotations

import dataclasses
import json
import math
import operator
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np

_COMPARISONS = {"<=": operator.le, ">=": operator.ge}


@dataclasses.dataclass(frozen=True)
class Figure:
    """One measured quantity and how it stands against its target.

    Attributes:
        name: A key, unique within its benchmark ("ratio_one_device").
        label: What ran against what, in words.
        unit: "x" for a ratio, else the unit of the samples ("GB/s", "ms", "MB").
        median: The median of the samples: the figure.
        low: The lowest sample.
        high: The highest sample.
        samples: How many samples the median is of.
        target: "<= 1.01" or ">= 0.95"; "" when the figure has none.
        met: Whether the median meets the target; None without one.
        interval: The 95% bootstrap interval of the median, when asked for.
    """

    name: str
    label: str
    unit: str
    median: float
    low: float
    high: float
    samples: int
    target: str = ""
    met: bool | None = None
    interval: tuple[float, float] | None = None


def figure(name: str, label: str, samples: Iterable[float], *, unit: str = "x",
           target: str = "", interval: bool = False) -> Figure:
    """Summarises samples as a Figure.

    Args:
        name: The figure's key.
        label: What ran against what.
        samples: The measurements (one per round, run or repeat); at least one.
        unit: "x" for a ratio, else the samples' unit.
        target: "<= X" or ">= X", or "" for none.
        interval: Also compute the 95% bootstrap interval of the median.

    Returns:
        The Figure.

    Example:
        figure("speedup_bf16", "mixed_bfloat16 / float32, steps/s", [1.7, 1.8, 1.6],
               target=">= 1.4")
    """
    values = [float(value) for value in samples]
    if not values:
        raise ValueError(f"figure {name!r}: no samples")
    median = statistics.median(values)
    met = None
    if target:
        comparison, threshold = target.split()
        met = bool(_COMPARISONS[comparison](median, float(threshold)))
    return Figure(name=name, label=label, unit=unit, median=median, low=min(values),
                  high=max(values), samples=len(values), target=target, met=met,
                  interval=median_interval(values) if interval else None)


def interleaved(variants: Mapping[str, Callable[[], object]], repeats: int,
                warmup: int = 3, before: Callable[[], object] | None = None
                ) -> dict[str, list[float]]:
    """Times each variant `repeats` times, alternating them, after `warmup` untimed rounds.

    Args:
        variants: Name -> a call that runs the variant once and returns when it is done
            (for a `tf.function`, one that reads its result back, so the time includes
            the work and not only its dispatch).
        repeats: Timed rounds.
        warmup: Untimed rounds first.
        before: An untimed call before each variant. For a collective timed in several
            processes, a barrier: a process that finished a large all-reduce first would
            otherwise time the next call from then, waiting for the last one.

    Returns:
        Name -> seconds of each timed call, in order.

    Example:
        seconds = interleaved({"raw": lambda: float(raw(x)), "tfdist": lambda: float(ours(x))},
                              repeats=10)
    """
    before = before or (lambda: None)
    for _ in range(warmup):
        for run in variants.values():
            before()
            run()
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, run in variants.items():
            before()
            start = time.perf_counter()
            run()
            seconds[name].append(time.perf_counter() - start)
    return seconds


def epoch_timer():
    """A Keras callback that records each epoch's wall time in seconds (`.seconds`).

    Keras is imported when this is called, so a benchmark can set its backend or
    TensorFlow's threads first.

    Example:
        timer = epoch_timer()
        model.fit(data, epochs=4, callbacks=[timer])
        steady = timer.seconds[1:]  # the first epoch traces and compiles
    """
    import keras

    class EpochTimer(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.seconds: list[float] = []
            self._started = 0.0

        def on_epoch_begin(self, epoch, logs=None):
            self._started = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            self.seconds.append(time.perf_counter() - self._started)

    return EpochTimer()


def median_interval(values: Sequence[float], confidence: float = 0.95,
                    resamples: int = 10_000, seed: int = 0) -> tuple[float, float]:
    """The percentile-bootstrap interval of the median of `values`.

    Args:
        values: Independent samples (for an A/B benchmark: one ratio per round).
        confidence: The interval's coverage.
        resamples: Bootstrap resamples.
        seed: Fixes the resampling, so a report reproduces from its samples.

    Returns:
        (low, high).
    """
    rng = np.random.default_rng(seed)
    data = np.asarray(values, dtype=np.float64)
    medians = np.median(rng.choice(data, size=(resamples, len(data)), replace=True), axis=1)
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(medians, [tail, 100 - tail])
    return float(low), float(high)


def rounded(value: float, digits: int = 4) -> float:
    """`value` to `digits` significant digits, for JSON meant to be read."""
    if value == 0 or not math.isfinite(value):
        return value
    return round(value, digits - 1 - int(math.floor(math.log10(abs(value)))))


def as_json(figure_: Figure) -> dict:
    """A Figure as a JSON-ready dict, numbers to 4 significant digits."""
    fields = dataclasses.asdict(figure_)
    for key in ("median", "low", "high"):
        fields[key] = rounded(fields[key])
    if figure_.interval:
        fields["interval"] = [rounded(bound) for bound in figure_.interval]
    return fields


def emit(benchmark: str, figures: Sequence[Figure], **details) -> None:
    """Prints the benchmark's last line: one JSON object.

    Args:
        benchmark: The benchmark's name (its script's, without .py).
        figures: Its figures, in the order a reader should see them.
        **details: More JSON-ready fields (settings, raw series for plots); each
            figure's median is also given under its name, so a reader of the line
            needs no list search.
    """
    names = [f.name for f in figures]
    if len(set(names)) != len(names):
        raise ValueError(f"{benchmark}: figure names repeat: {names}")
    print(json.dumps({"benchmark": benchmark, **details,
                      **{f.name: rounded(f.median) for f in figures},
                      "figures": [as_json(f) for f in figures]}), flush=True)
