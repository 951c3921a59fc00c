"""Model parallelism over 2 devices: each stage's bytes, the pipeline's bubble, tensor parallelism.

One process, `one_device` with `model_parallel.devices: 2` (2 logical CPU devices here),
one intra-op thread per op, so that each device's work runs on one core and the 2 cores
show what overlap there is:

1. Bytes: a `Pipeline` of 8 equal Dense blocks with `balance=None`: each device's
   variable bytes and Adam-state bytes (read from the variables on it) against 1/2 of the
   whole.
2. Bubble: the same 8 blocks trained with M = 1, 2, 4, 8 micro-batches (one model each,
   the same weights), step times interleaved after a warm-up. GPipe's ideal step time
   with K stages is (M + K - 1) / (K M) of the serial time: at K = 2, M = 4 ideally takes
   5/8 of M = 1's time, a speed-up of 1.6; the figure is the measured speed-up over it.
3. Tensor parallelism: a ColumnParallelDense / RowParallelDense pair against the plain
   Dense pair, step time ratio.

    .venv/bin/python benchmarks/pipeline.py [--units 1024] [--batch 1024] [--repeats 9]

The last line is JSON: the figures, the step times by M, and the bytes per device.
"""

from __future__ import annotations

import argparse
import os
import sys

from method import emit, figure, interleaved

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

BLOCKS, STAGES = 8, 2
MICRO_BATCHES = (1, 2, 4, 8)


def ideal_speedup(micro_batches: int, stages: int = STAGES) -> float:
    """GPipe's step time is (M + K - 1) / (K M) of the serial time: the speed-up of M
    micro-batches over one (whose time is K / K = 1 of it)."""
    return 1.0 / ((micro_batches + stages - 1) / (stages * micro_batches))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--units", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=9, help="timed steps per setting")
    args = parser.parse_args()

    import keras
    import numpy as np
    import tensorflow as tf

    import tfdist
    from tfdist.parallel import ColumnParallelDense, Pipeline, RowParallelDense

    runner = tfdist.Runner(tfdist.load_config(overrides={
        "strategy": "one_device", "precision": "float32", "model_parallel.devices": STAGES,
        "threads.intra_op": 1, "threads.inter_op": 4}))
    rng = np.random.default_rng(0)
    features = rng.standard_normal((args.batch, args.units), dtype=np.float32)
    labels = rng.standard_normal((args.batch, args.units), dtype=np.float32)

    def blocks():
        return [keras.layers.Dense(args.units, activation="relu") for _ in range(BLOCKS)]

    models = {}
    weights = None
    for micro_batches in MICRO_BATCHES:
        with runner.scope():
            model = Pipeline(blocks(), micro_batches=micro_batches, input_shape=(args.units,))
            if weights is None:
                weights = model.get_weights()
            model.set_weights(weights)
            model.compile(runner.optimizer(keras.optimizers.Adam(1e-4)), "mse")
        models[f"m{micro_batches}"] = model
    with runner.scope():
        column = keras.Sequential([keras.Input((args.units,)),
                                   ColumnParallelDense(4 * args.units, activation="relu"),
                                   RowParallelDense(args.units)])
        column.compile(runner.optimizer(keras.optimizers.Adam(1e-4)), "mse")
    with tf.device(runner.model_devices[0]):
        plain_pair = keras.Sequential([keras.Input((args.units,)),
                                       keras.layers.Dense(4 * args.units, activation="relu"),
                                       keras.layers.Dense(args.units)])
        plain_pair.compile(keras.optimizers.Adam(1e-4), "mse")
    models["tensor_parallel"], models["plain_pair"] = column, plain_pair

    def step(model):
        return lambda: float(model.train_on_batch(features, labels))

    seconds = interleaved({name: step(model) for name, model in models.items()},
                          repeats=args.repeats, warmup=3)

    balanced = models["m1"]
    per_device = {}
    for device in runner.model_devices:
        name = device.split("device:")[-1]
        variables = sum(int(np.prod(v.shape)) * 4 for v in balanced.trainable_variables
                        if v.value.device.endswith(name))
        state = sum(int(np.prod(v.shape)) * 4 for v in balanced.optimizer.variables
                    if len(v.shape) and v.value.device.endswith(name))
        per_device[name] = {"variable_bytes": variables, "adam_bytes": state}
    whole = sum(row["variable_bytes"] for row in per_device.values())
    figures = [figure(f"stage_share_{name}", f"{name}'s variable bytes / (whole / {STAGES}), "
                      f"balance=None {balanced.balance}",
                      [row["variable_bytes"] / (whole / STAGES)], target="<= 1.1")
               for name, row in per_device.items()]
    figures.append(figure("adam_over_variables", "Adam-state bytes / variable bytes, each device",
                          [row["adam_bytes"] / row["variable_bytes"]
                           for row in per_device.values()]))
    serial = seconds["m1"]
    for micro_batches in MICRO_BATCHES[1:]:
        speedups = [one / many for one, many in zip(serial, seconds[f"m{micro_batches}"])]
        figures.append(figure(
            f"speedup_m{micro_batches}", f"step time M=1 / M={micro_batches} "
            f"(GPipe's ideal: {ideal_speedup(micro_batches):.2f})", speedups))
    figures.append(figure(
        "speedup_m4_of_ideal", "(step time M=1 / M=4) / GPipe's ideal 1.6",
        [one / four / ideal_speedup(4) for one, four in zip(serial, seconds["m4"])],
        target=">= 0.8"))
    ratios = [tp / plain for tp, plain in zip(seconds["tensor_parallel"], seconds["plain_pair"])]
    figures.append(figure("tensor_parallel_time_ratio",
                          "Column/RowParallelDense pair / plain Dense pair, step time", ratios))
    print("step ms by M: " + ", ".join(
        f"M={m} {1000 * sorted(seconds[f'm{m}'])[len(serial) // 2]:.1f}"
        for m in MICRO_BATCHES), flush=True)
    emit("pipeline", figures, units=args.units, batch=args.batch, per_device=per_device,
         balance=balanced.balance,
         step_seconds={name: values for name, values in seconds.items()})


if __name__ == "__main__":
    main()
