"""What mixed_bfloat16 buys over float32 on a matmul-heavy model, end to end, through tfdist.

Two runners (`precision: float32` and `precision: mixed_bfloat16`) train the same
wide MLP (1024 -> 2048 -> 2048 -> 1024 -> 10) with `model.fit` under `one_device`,
alternating epoch by epoch; the first round is warm-up. For reference, the same
run measures a bare 2048 x 2048 matmul in both dtypes (GFLOP/s): the ceiling the
end-to-end figure is chasing.

    .venv/bin/python benchmarks/precision.py [--rounds 7] [--steps 20] [--batch 512]
        [--matmul_size 2048]

The last line is JSON; `speedup_bf16` is float32's median step time over
mixed_bfloat16's (the target on a CPU with AVX512_BF16 or AMX is >= 1.4).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfdist  # noqa: E402
from tfdist import bfloat16_probe  # noqa: E402
from method import emit, figure  # noqa: E402
from tfdist.callbacks import Throughput  # noqa: E402
from tfdist.cluster import detect_cluster  # noqa: E402

FEATURES, WIDTH, CLASSES, BATCH = 1024, 2048, 10, 512
MATMUL_SIZE = 2048


def build_model() -> keras.Model:
    return keras.Sequential([
        keras.Input((FEATURES,)),
        keras.layers.Dense(WIDTH, activation="relu"),
        keras.layers.Dense(WIDTH, activation="relu"),
        keras.layers.Dense(FEATURES, activation="relu"),
        keras.layers.Dense(CLASSES),
        keras.layers.Activation("softmax", dtype="float32"),
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7,
                        help="epochs per policy; the first is warm-up")
    parser.add_argument("--steps", type=int, default=20, help="steps per epoch")
    parser.add_argument("--batch", type=int, default=BATCH, help="examples per step")
    parser.add_argument("--matmul_size", type=int, default=MATMUL_SIZE,
                        help="the side of the bare matmul (the `precision: auto` probe's)")
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    count = args.steps * args.batch
    data = tf.data.Dataset.from_tensor_slices(
        (rng.standard_normal((count, FEATURES), dtype=np.float32),
         rng.integers(0, CLASSES, count).astype(np.int32)))
    runs = {}
    for precision in ("float32", "mixed_bfloat16"):
        runner = tfdist.Runner(tfdist.load_config(overrides={
            "strategy": "one_device", "precision": precision}))
        with runner.scope():
            model = build_model()
            model.compile(optimizer=runner.optimizer(keras.optimizers.Adam(1e-4)),
                          loss="sparse_categorical_crossentropy")
        runs[precision] = (model, runner.dataset(data, args.batch), Throughput(args.batch))
    for _ in range(args.rounds):
        for model, dataset, timer in runs.values():  # interleaved A/B
            model.fit(dataset, epochs=1, verbose=0, shuffle=False, callbacks=[timer])
    # Median rate over rounds after the first, as milliseconds per step.
    step_ms = {p: args.batch / t.examples_per_sec * 1e3 for p, (_, _, t) in runs.items()}
    float32_rates, bfloat16_rates = (runs[p][2].epoch_rates[1:]
                                     for p in ("float32", "mixed_bfloat16"))
    speedups = [bf16 / f32 for f32, bf16 in zip(float32_rates, bfloat16_rates)]
    # The probe `precision: auto` runs, at a larger size and more rounds (interleaved).
    probe = bfloat16_probe.measure(size=args.matmul_size, rounds=20)
    gflops = {"float32": probe.float32_gflops, "bfloat16": probe.bfloat16_gflops}
    # The target holds where the CPU has bfloat16 instructions; elsewhere bfloat16 is
    # emulated, `precision: auto` picks float32, and the figure is reported without one.
    bf16_flags = detect_cluster(probe_gpus=False).cpu_bf16
    speedup = figure("speedup_bf16", "mixed_bfloat16 / float32, end-to-end steps/s (MLP)"
                     + ("" if bf16_flags else "; no bfloat16 instructions on this CPU"),
                     speedups, target=">= 1.4" if bf16_flags else "")

    print(f"{'policy':<16} {'ms/step':>9}")
    for precision, milliseconds in step_ms.items():
        print(f"{precision:<16} {milliseconds:>9.2f}")
    print(f"end-to-end speed-up of mixed_bfloat16: {speedup.median:.2f}x "
          f"({speedup.low:.2f}-{speedup.high:.2f})")
    print(f"bare {args.matmul_size}^2 matmul: float32 {gflops['float32']:.0f} GFLOP/s, "
          f"bfloat16 {gflops['bfloat16']:.0f} GFLOP/s "
          f"({gflops['bfloat16'] / gflops['float32']:.2f}x)")
    emit("precision", [
        speedup,
        figure("matmul_speedup_bf16", f"bfloat16 / float32, bare {args.matmul_size}^2 matmul "
               "GFLOP/s (the `precision: auto` probe)", [probe.speedup]),
    ], rounds=args.rounds, steps_per_epoch=args.steps, global_batch_size=args.batch,
        cpu_bf16_flags=bf16_flags,
        step_ms={k: round(v, 2) for k, v in step_ms.items()},
        matmul_gflops={k: round(v, 1) for k, v in gflops.items()})


if __name__ == "__main__":
    main()
