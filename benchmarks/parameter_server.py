"""parameter_server: `model.fit` through tfdist against a hand-written coordinator loop.

A local cluster (tfdist launch -n W --ps 1) per worker count W in (1, 2). On the
chief, for each `steps_per_execution` s in (1, 10, 100), one model trains in
alternating rounds:

- raw: the loop of TensorFlow's parameter-server guide, by hand: a per-worker
  dataset, a `tf.function` running s of the model's `train_step`, scheduled
  `--steps / s` times, then `coordinator.join()`;
- tfdist: `model.fit(runner.dataset(...), steps_per_epoch=--steps)`, one epoch
  per block, timed by a callback from the epoch's start to its end.

Each figure is the median steps per second over blocks after the first
(warm-up excluded), and the headline is tfdist/raw for every W and s.

    .venv/bin/python benchmarks/parameter_server.py [--steps 300] [--repeats 2]

The last line is JSON: steps/s of both and their ratio per setting, and the lowest ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from method import emit, epoch_timer, figure
from processes import run_children, tfdist_launch, write_report

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

STEPS_PER_EXECUTION = (1, 10, 100)
BATCH = 64


def raw_function(strategy, model, steps):
    """The guide's scheduled function: `steps` train steps in a graph loop."""
    import tensorflow as tf

    @tf.function
    def raw_steps(iterator):
        if steps == 1:
            strategy.run(model.train_step, args=(next(iterator),))
            return
        for _ in tf.range(steps):
            strategy.run(model.train_step, args=(next(iterator),))

    return raw_steps


def measure_on_chief(args: argparse.Namespace) -> None:
    """Runs on every task; the chief times both loops and reports their rates."""
    import keras
    import numpy as np
    import tensorflow as tf

    import tfdist

    runner = tfdist.Runner(tfdist.load_config(overrides={  # Serves on workers and ps.
        "strategy": "parameter_server", "seed": 0}))
    strategy = runner.strategy
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    rng = np.random.default_rng(0)
    features = rng.random((BATCH * 16, 256), dtype=np.float32)
    labels = rng.integers(0, 10, len(features)).astype("int32")
    examples = tf.data.Dataset.from_tensor_slices((features, labels))
    results = {}
    for spe in args.spe:
        with runner.scope():
            model = keras.Sequential([keras.Input((256,)),
                                      keras.layers.Dense(256, activation="relu"),
                                      keras.layers.Dense(10)])
            model.compile(runner.optimizer(keras.optimizers.SGD(0.01)),
                          keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                          steps_per_execution=spe)
        data = runner.dataset(examples, BATCH)
        model.fit(data, epochs=1, steps_per_epoch=spe, verbose=0)  # Builds every variable.

        def dataset_fn():
            return tf.data.Dataset.from_tensor_slices((features, labels)).repeat().batch(
                BATCH, drop_remainder=True)

        iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

        raw_steps = raw_function(strategy, model, spe)

        raw, fitted = [], []
        for _ in range(2):  # Rounds, alternating the two loops.
            for _ in range(args.repeats + 1):
                start = time.perf_counter()
                for _ in range(args.steps // spe):
                    coordinator.schedule(raw_steps, args=(iterator,))
                coordinator.join()
                raw.append(args.steps / (time.perf_counter() - start))
            timer = epoch_timer()
            model.fit(data, epochs=args.repeats + 1, steps_per_epoch=args.steps,
                      callbacks=[timer], verbose=0)
            fitted.extend(args.steps / seconds for seconds in timer.seconds)
        # Warm-up excluded: the first block of each round.
        raw_rates = raw[1:args.repeats + 1] + raw[args.repeats + 2:]
        fit_rates = fitted[1:args.repeats + 1] + fitted[args.repeats + 2:]
        results[spe] = {"raw": raw_rates, "tfdist": fit_rates}
    if runner.is_chief:
        write_report(args.output, results)


def run_cluster(workers: int, args: argparse.Namespace) -> dict:
    results = run_children([*tfdist_launch(workers, parameter_servers=1), sys.executable,
                            os.path.abspath(__file__), "--measure", f"--steps={args.steps}",
                            f"--repeats={args.repeats}", *(f"--spe={spe}" for spe in args.spe)],
                           what=f"the {workers}-worker cluster")
    return {int(spe): figures for spe, figures in results.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300,
                        help="steps per timed block (a multiple of every --spe)")
    parser.add_argument("--repeats", type=int, default=2, help="timed blocks per round")
    parser.add_argument("--spe", type=int, action="append",
                        help="steps_per_execution values (default: 1, 10, 100)")
    parser.add_argument("--workers", type=int, action="append",
                        help="worker counts (default: 1, 2)")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--output", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.spe = args.spe or list(STEPS_PER_EXECUTION)
    if any(args.steps % spe for spe in args.spe):
        parser.error(f"--steps {args.steps} must be a multiple of every --spe {args.spe}")
    if args.measure:
        measure_on_chief(args)
        return
    figures, series = [], {}
    print(f"{'workers':>7} {'spe':>4} {'raw steps/s':>12} {'tfdist steps/s':>15} {'ratio':>6}")
    for workers in args.workers or [1, 2]:
        for spe, result in run_cluster(workers, args).items():
            # Block i of tfdist against block i of the raw loop, from the same round.
            ratio = figure(f"w{workers}_spe{spe}_ratio", f"{workers} worker(s), "
                           f"steps_per_execution {spe}: tfdist / raw ClusterCoordinator, steps/s",
                           [ours / raw for raw, ours in zip(result["raw"], result["tfdist"])],
                           target=">= 0.95")
            figures.append(ratio)
            series[f"w{workers}_spe{spe}"] = {
                name: round(statistics.median(rates), 2) for name, rates in result.items()}
            print(f"{workers:>7} {spe:>4} {series[f'w{workers}_spe{spe}']['raw']:>12.1f} "
                  f"{series[f'w{workers}_spe{spe}']['tfdist']:>15.1f} {ratio.median:>6.3f}",
                  flush=True)
    emit("parameter_server", figures, steps=args.steps, repeats=args.repeats,
         steps_per_sec=series, min_ratio=round(min(f.median for f in figures), 4),
         **{f"{key}_{name}": value for key, rates in series.items()
            for name, value in rates.items()})


if __name__ == "__main__":
    main()
