"""Weak scaling of `multi_worker`: 1 worker against 2, same per-worker batch, same model.

Each worker is a process started by `tfdist launch`, pinned to its own core
before TensorFlow starts, with one intra-op thread. The model is convolutional,
so its gradients are small (about 0.1 MB) next to its compute: the benchmark
measures what synchronisation costs when compute dominates. The 1- and
2-worker runs alternate; each figure is the median over epochs after the first,
then over repeats.

    .venv/bin/python benchmarks/scaling.py [--repeats 2] [--epochs 3] [--steps 30]

The last line is JSON: `efficiency` = (2-worker examples/s) / (2 x 1-worker
examples/s); the target is >= 0.85.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

from method import emit, figure
from processes import run_children, tfdist_launch, write_report

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

PER_WORKER_BATCH = 64


def worker(args: argparse.Namespace) -> None:
    """One worker: pin to a core, train, and (on the chief) report examples/s."""
    from tfdist.cluster import detect_cluster

    info = detect_cluster(probe_gpus=False)
    if args.pin:
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[info.tf_config.task_index % len(cores)]})  # before TF

    import keras
    import numpy as np
    import tensorflow as tf

    import tfdist
    from tfdist.callbacks import Throughput

    workers = info.tf_config.num_workers
    runner = tfdist.Runner(tfdist.load_config(overrides={
        "strategy": "multi_worker", "precision": "float32", "seed": 0,
        "threads.intra_op": 1, "threads.inter_op": workers + 2}))
    global_batch = PER_WORKER_BATCH * workers
    rng = np.random.default_rng(0)
    count = global_batch * args.steps
    data = tf.data.Dataset.from_tensor_slices(
        (rng.standard_normal((count, 32, 32, 3), dtype=np.float32),
         rng.integers(0, 10, count).astype(np.int32)))
    with runner.scope():
        model = keras.Sequential([
            keras.Input((32, 32, 3)),
            keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
            keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(10, activation="softmax"),
        ])
        model.compile(optimizer=runner.optimizer(keras.optimizers.SGD(0.01)),
                      loss="sparse_categorical_crossentropy")
    throughput = Throughput(global_batch)
    model.fit(runner.dataset(data, global_batch), epochs=args.epochs, shuffle=False, verbose=0,
              callbacks=[throughput])
    if runner.is_chief:
        write_report(args.output, {"workers": workers,
                                   "examples_per_sec": throughput.examples_per_sec,
                                   "parameters": model.count_params()})


def run_group(workers: int, args: argparse.Namespace) -> dict:
    return run_children([*tfdist_launch(workers), sys.executable, os.path.abspath(__file__),
                         "--worker", f"--epochs={args.epochs}", f"--steps={args.steps}",
                         "--pin" if args.pin else "--no-pin"],
                        what=f"the {workers}-worker run")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--output", help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=2, help="alternating runs of each size")
    parser.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                        help="pin each worker to its own core (--no-pin: let the OS place them)")
    parser.add_argument("--epochs", type=int, default=3,
                        help="epochs per run; the first is warm-up")
    parser.add_argument("--steps", type=int, default=30,
                        help="steps per epoch (short epochs, a few seconds, measure noise)")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    rates: dict[int, list[float]] = {1: [], 2: []}
    parameters = 0
    for _ in range(args.repeats):
        for workers in (1, 2):
            result = run_group(workers, args)
            rates[workers].append(result["examples_per_sec"])
            parameters = result["parameters"]
    one, two = statistics.median(rates[1]), statistics.median(rates[2])
    # One efficiency per repeat: its 2-worker run over the 1-worker run just before it.
    efficiency = figure("efficiency", "multi_worker weak scaling: 2 workers / (2 x 1 worker), "
                        "examples/s (2 pinned cores; see the sync cost projection)",
                        [pair / (2 * single) for single, pair in zip(rates[1], rates[2])],
                        target=">= 0.85")
    print(f"{'workers':>7} {'examples/s':>11}   (per-worker batch {PER_WORKER_BATCH}, "
          f"{parameters} parameters)")
    print(f"{1:>7} {one:>11.1f}")
    print(f"{2:>7} {two:>11.1f}")
    print(f"weak-scaling efficiency: {efficiency.median:.3f} "
          f"({efficiency.low:.3f}-{efficiency.high:.3f})")
    emit("scaling", [efficiency],
         examples_per_sec={"1": round(one, 1), "2": round(two, 1)},
         per_worker_batch=PER_WORKER_BATCH, repeats=args.repeats,
         runs={str(k): [round(v, 1) for v in vs] for k, vs in rates.items()})


if __name__ == "__main__":
    main()
