"""Gradient accumulation: the memory it saves, what it costs in time, the communication it saves.

1. Memory: a fresh process per setting trains a small CNN (64x64 images) under
   `one_device`; peak resident memory (`ru_maxrss`) of micro-batch b with k = 8
   against batch b with k = 1, with batch 8b, k = 1 beside them.
2. Time per sample, in the same processes: k = 8 with micro-batch b against
   k = 1 with batch 8b (the same update).
3. Communication: a wide MLP (3 Dense layers of 2048, 12.6 M parameters, 50 MB of
   gradients) with 2 local processes under `multi_worker` (tfdist launch) and
   `horovod` (mpirun): samples per second with k = 8 against k = 1 at the same
   micro-batch.

Times are medians over epochs after the first (warm-up excluded).

    .venv/bin/python benchmarks/accumulation.py [--micro_batch 32] [--epochs 4]

The last line is JSON: the three memory figures and their ratios, the time ratio,
and the k = 8 / k = 1 speed-ups under multi_worker and horovod.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import sys

from method import emit, epoch_timer, figure
from processes import mpirun, run_children, tfdist_launch, write_report

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

K = 8


def run_setting(args: argparse.Namespace) -> None:
    """One training run; the chief reports its peak memory and time per sample."""
    import keras
    import numpy as np
    import tensorflow as tf

    import tfdist

    runner = tfdist.Runner(tfdist.load_config(overrides={
        "strategy": args.run, "accumulation_steps": args.steps, "seed": 0}))
    rng = np.random.default_rng(0)
    if args.model == "cnn":
        features = rng.random((256, args.image, args.image, 3), dtype=np.float32)
        layers = [keras.Input((args.image, args.image, 3)),
                  *[keras.layers.Conv2D(32, 3, padding="same", activation="relu")
                    for _ in range(3)],
                  keras.layers.GlobalAveragePooling2D()]
    else:
        features = rng.random((256, 1024), dtype=np.float32)
        layers = [keras.Input((1024,)),
                  *[keras.layers.Dense(args.mlp_units, activation="relu") for _ in range(3)]]
    labels = rng.integers(0, 10, len(features)).astype("int32")
    with runner.scope():
        model = keras.Sequential([*layers, keras.layers.Dense(10, activation="softmax")])
        model.compile(runner.optimizer(keras.optimizers.SGD(0.01)),
                      "sparse_categorical_crossentropy")
    data = runner.dataset(tf.data.Dataset.from_tensor_slices((features, labels)).repeat(),
                          args.batch)
    steps_per_epoch = args.updates_per_epoch * args.steps

    timer = epoch_timer()
    model.fit(data, epochs=args.epochs, steps_per_epoch=steps_per_epoch, callbacks=[
        *runner.callbacks(), timer], verbose=0)
    if runner.is_chief:
        write_report(args.output, {
            "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "samples_per_sec": [steps_per_epoch * args.batch / seconds
                                for seconds in timer.seconds[1:]]})


def measure(launcher: list[str], strategy: str, model: str, batch: int, steps: int,
            args: argparse.Namespace) -> dict:
    """Runs one setting in fresh processes; returns the chief's peak memory (MB) and
    samples/s of each epoch after the first."""
    return run_children([*launcher, sys.executable, os.path.abspath(__file__),
                         f"--run={strategy}", f"--model={model}", f"--batch={batch}",
                         f"--steps={steps}", f"--epochs={args.epochs}",
                         f"--updates_per_epoch={args.updates_per_epoch}",
                         f"--image={args.image}", f"--mlp_units={args.mlp_units}"],
                        what=f"accumulation: {strategy}, {model}, k={steps}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--micro_batch", type=int, default=32, help="b, per forward pass")
    parser.add_argument("--epochs", type=int, default=4, help="epochs per run (first: warm-up)")
    parser.add_argument("--updates_per_epoch", type=int, default=3)
    parser.add_argument("--run", help=argparse.SUPPRESS)
    parser.add_argument("--model", default="cnn", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--output", help=argparse.SUPPRESS)
    # Smaller models for the test suite's smoke run; the figures use the defaults.
    parser.add_argument("--image", type=int, default=64, help=argparse.SUPPRESS)
    parser.add_argument("--mlp_units", type=int, default=2048, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        run_setting(args)
        return
    b = args.micro_batch
    small = measure([], "one_device", "cnn", b, 1, args)
    accumulated = measure([], "one_device", "cnn", b, K, args)
    large = measure([], "one_device", "cnn", K * b, 1, args)
    rate = {name: statistics.median(run["samples_per_sec"])
            for name, run in (("b", small), ("b_k8", accumulated), ("8b", large))}
    figures = [
        figure("memory_ratio_k8_vs_b", f"peak memory: micro-batch {b} x k={K} / batch {b}",
               [accumulated["maxrss_mb"] / small["maxrss_mb"]], target="<= 1.15"),
        figure("memory_ratio_8b_vs_b", f"peak memory: batch {K * b} / batch {b} "
               "(what accumulation avoids)", [large["maxrss_mb"] / small["maxrss_mb"]]),
        figure("time_ratio_k8_vs_8b", f"time per sample: micro-batch {b} x k={K} / batch {K * b}",
               [big / acc for big, acc in zip(large["samples_per_sec"],
                                              accumulated["samples_per_sec"])],
               target="<= 1.15")]
    print(f"memory (MB): batch {b}: {small['maxrss_mb']:.0f}; micro-batch {b} x {K}: "
          f"{accumulated['maxrss_mb']:.0f}; batch {K * b}: {large['maxrss_mb']:.0f}")
    print(f"samples/s: micro-batch {b} x {K}: {rate['b_k8']:.0f}; batch {K * b}: {rate['8b']:.0f}")
    launchers = {"multi_worker": tfdist_launch(2)}
    if shutil.which("mpirun"):
        launchers["horovod"] = mpirun(2)
    communication = {}
    for strategy, launcher in launchers.items():
        one = measure(launcher, strategy, "mlp", b, 1, args)
        eight = measure(launcher, strategy, "mlp", b, K, args)
        speedup = figure(f"speedup_k8_{strategy}", f"{strategy}, 2 processes, 50 MB of "
                         f"gradients: samples/s at k={K} / k=1",
                         [e / o for o, e in zip(one["samples_per_sec"], eight["samples_per_sec"])],
                         target=">= 1.5")
        figures.append(speedup)
        communication[strategy] = {"k1": statistics.median(one["samples_per_sec"]),
                                   "k8": statistics.median(eight["samples_per_sec"])}
        print(f"{strategy}, wide MLP, micro-batch {b}: {communication[strategy]['k1']:.0f} "
              f"samples/s (k=1), {communication[strategy]['k8']:.0f} (k={K}): "
              f"{speedup.median:.2f}x")
    emit("accumulation", figures, micro_batch=b, k=K,
         maxrss_mb={"b_k1": round(small["maxrss_mb"]), "b_k8": round(accumulated["maxrss_mb"]),
                    "8b_k1": round(large["maxrss_mb"])},
         samples_per_sec={"cnn": {k: round(v, 1) for k, v in rate.items()},
                          **{f"mlp_{k}": {kk: round(vv, 1) for kk, vv in v.items()}
                             for k, v in communication.items()}})


if __name__ == "__main__":
    main()
