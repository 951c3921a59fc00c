"""What tfdist costs: the same training through tfdist and through hand-written tf.distribute.

For `one_device` and `mirrored` (2 logical CPU devices), two identical models train
on the same data, one built through a tfdist Runner and one through a strategy and
`model.fit` written by hand (batch, drop_remainder, prefetch: what a careful user
writes). The two alternate epoch by epoch in one process, so both see the same
machine load. The first round (tracing) is left out; the figures are medians.

    .venv/bin/python benchmarks/overhead.py [--rounds 21] [--steps 40]

Each round gives one ratio (tfdist's epoch time over the hand-written one's in the
same round), so a slow stretch of the shared machine hits both sides of it. The
figure is the median ratio with its 95% bootstrap interval: an interval that holds
1.0 and is under 1% wide says any cost left is below what this machine can resolve.

The same rounds also give the ratio of the process's CPU time per epoch (all its
threads), which a shared machine's steal time does not reach: the work tfdist adds,
resolved more finely than wall time can.

The last line is JSON: `ratio_one_device` and `ratio_mirrored` are tfdist's median
step time over the hand-written one's (1.00 is no cost; the target is <= 1.01);
`cpu_ratio_*` the same for CPU time.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfdist  # noqa: E402
from method import emit, figure  # noqa: E402
from tfdist.callbacks import Throughput  # noqa: E402
from tfdist.devices import split_cpu  # noqa: E402
from workloads import BATCH, classifier, examples  # noqa: E402


def through_tfdist(strategy_name: str, data: tf.data.Dataset):
    runner = tfdist.Runner(tfdist.load_config(overrides={
        "strategy": strategy_name, "precision": "float32", "mirrored.cpu_replicas": 2}))
    with runner.scope():
        model = classifier()
        model.compile(optimizer=runner.optimizer(keras.optimizers.Adam(1e-3)),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model, runner.dataset(data, BATCH), runner.callbacks()


def by_hand(strategy_name: str, data: tf.data.Dataset):
    if strategy_name == "mirrored":
        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    else:
        strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    with strategy.scope():
        model = classifier()
        model.compile(optimizer=keras.optimizers.Adam(1e-3),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model, data.batch(BATCH, drop_remainder=True).prefetch(tf.data.AUTOTUNE), []


def measure(strategy_name: str, rounds: int, steps: int) -> dict:
    data = examples(steps)
    runs = {"tfdist": through_tfdist(strategy_name, data), "by_hand": by_hand(strategy_name, data)}
    timers = {name: Throughput(BATCH) for name in runs}  # one rate per fit call
    cpu_seconds = {name: [] for name in runs}
    for _ in range(rounds):
        for name, (model, dataset, callbacks) in runs.items():  # interleaved A/B
            started = time.process_time()
            model.fit(dataset, epochs=1, verbose=0, shuffle=False,
                      callbacks=[*callbacks, timers[name]])
            cpu_seconds[name].append(time.process_time() - started)
    # Seconds per step from the median rate over rounds after the first.
    medians = {name: BATCH / timer.examples_per_sec for name, timer in timers.items()}
    ratios = [by_hand / tfdist for tfdist, by_hand in zip(timers["tfdist"].epoch_rates[1:],
                                                          timers["by_hand"].epoch_rates[1:])]
    cpu_ratios = [tfdist / by_hand for tfdist, by_hand in zip(cpu_seconds["tfdist"][1:],
                                                              cpu_seconds["by_hand"][1:])]
    return {"tfdist_step_ms": medians["tfdist"] * 1e3, "by_hand_step_ms": medians["by_hand"] * 1e3,
            "ratios": ratios, "cpu_ratios": cpu_ratios}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=21,
                        help="epochs per variant; the first is warm-up")
    parser.add_argument("--steps", type=int, default=40, help="steps per epoch")
    args = parser.parse_args()
    split_cpu(2)
    results = {name: measure(name, args.rounds, args.steps) for name in ("one_device", "mirrored")}
    figures = [figure(f"ratio_{name}", f"{name}: tfdist / hand-written tf.distribute, step time",
                      result["ratios"], target="<= 1.01", interval=True)
               for name, result in results.items()]
    # The work done rather than the wall time: CPU time is not charged for the time a
    # shared machine gives to others, so it resolves a smaller cost.
    cpu_figures = [figure(f"cpu_ratio_{name}", f"{name}: tfdist / hand-written tf.distribute, "
                          "process CPU time per epoch", result["cpu_ratios"], interval=True)
                   for name, result in results.items()]
    print(f"{'strategy':<12} {'tfdist ms/step':>15} {'by hand ms/step':>16} {'ratio':>7} "
          f"{'95% interval':>15}")
    for (name, result), ratio, cpu in zip(results.items(), figures, cpu_figures):
        low, high = ratio.interval
        print(f"{name:<12} {result['tfdist_step_ms']:>15.2f} {result['by_hand_step_ms']:>16.2f} "
              f"{ratio.median:>7.3f} {low:>7.3f}-{high:.3f}   CPU time {cpu.median:.3f} "
              f"({cpu.interval[0]:.3f}-{cpu.interval[1]:.3f})")
    emit("overhead", [*figures, *cpu_figures], rounds=args.rounds, steps_per_epoch=args.steps,
         global_batch_size=BATCH,
         **{f"step_ms_{name}": {k: round(v, 3) for k, v in result.items()
                                if not k.endswith("ratios")}
            for name, result in results.items()})


if __name__ == "__main__":
    main()
