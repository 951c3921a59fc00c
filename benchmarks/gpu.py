"""`make bench-gpu`: synthetic ResNet-50 images/s on one GPU, as Horovod's synthetic benchmark.

The format and method of Horovod's examples/tensorflow2/tensorflow2_synthetic_benchmark.py
(random images, 10 warm-up batches, then `--iters` rounds of `--batches_per_iter`
batches, "Img/sec per GPU: mean +-1.96 x std"), run through tfdist with `model.fit`:

- strategies `one_device`, `mirrored` (one GPU) and `horovod` (mpirun -np 1);
- precision float32 (TF32 off), tf32 (float32 with TensorFloat-32 matmuls, TensorFlow's
  default on Ampere and later), mixed_float16 and mixed_bfloat16;
- XLA off and on (`jit_compile`) under `one_device`;
- peak GPU memory of batch B against micro-batch B/4 with k = 4 accumulation (the
  same update).

Each variant runs in a fresh process. Where TensorFlow sees no GPU, nothing is
measured and the JSON line says so; `--cpu` runs the same code on the CPU, as a
check of the code and not a measurement.

    .venv/bin/python benchmarks/gpu.py [--batch 64] [--iters 10] [--batches_per_iter 10]

The last line is JSON: images/s per variant, the speed-ups over float32, and the
peak memory ratio of k = 4.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from method import emit, figure
from processes import mpirun, run_children, write_report

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

PRECISIONS = ("float32", "tf32", "mixed_float16", "mixed_bfloat16")


def variants() -> list[tuple[str, str, bool]]:
    """(strategy, precision, xla) to run."""
    chosen = [("one_device", precision, xla) for precision in PRECISIONS for xla in (False, True)]
    chosen += [(strategy, precision, False) for strategy in ("mirrored", "horovod")
               for precision in ("tf32", "mixed_bfloat16")]
    return chosen


def run_variant(args: argparse.Namespace) -> None:
    """One variant in this process: prints Horovod's lines, then a JSON line."""
    import keras
    import numpy as np
    import tensorflow as tf

    import tfdist

    tf.config.experimental.enable_tensor_float_32_execution(args.precision != "float32")
    policy = "float32" if args.precision in ("float32", "tf32") else args.precision
    overrides = {"strategy": args.strategy, "precision": policy, "seed": 0,
                 "accumulation_steps": args.accumulation}
    if args.cpu:
        overrides["one_device.device"] = "/cpu:0"
        overrides["mirrored.devices"] = ["/cpu:0"]
    runner = tfdist.Runner(tfdist.load_config(overrides=overrides))
    batch = args.batch // args.accumulation
    with runner.scope():
        shape = (args.image, args.image, 3)
        if args.model == "resnet50":
            model = keras.applications.ResNet50(weights=None, input_shape=shape)
        else:  # to check this benchmark's code quickly, not to measure
            model = keras.Sequential([keras.Input(shape),
                                      keras.layers.Conv2D(8, 3, activation="relu"),
                                      keras.layers.GlobalAveragePooling2D(),
                                      keras.layers.Dense(1000, activation="softmax")])
        model.compile(optimizer=runner.optimizer(keras.optimizers.SGD(0.01)),
                      loss="sparse_categorical_crossentropy", jit_compile=args.xla)
    rng = np.random.default_rng(0)
    data = tf.data.Dataset.from_tensor_slices(
        (rng.random((batch, args.image, args.image, 3), dtype=np.float32),
         rng.integers(0, 1000, batch).astype("int32"))).repeat()
    dataset = runner.dataset(data, batch)

    def benchmark_step(steps):
        model.fit(dataset, steps_per_epoch=steps, epochs=1, verbose=0,
                  callbacks=runner.callbacks())

    model_name = "ResNet50" if args.model == "resnet50" else args.model
    print(f"Model: {model_name}, batch size: {args.batch}, strategy: {args.strategy}, "
          f"precision: {args.precision}, XLA: {args.xla}, accumulation: {args.accumulation}")
    benchmark_step(10 * args.accumulation)  # warm-up
    rates = []
    for iteration in range(args.iters):
        started = time.perf_counter()
        benchmark_step(args.batches_per_iter * args.accumulation)
        rate = args.batch * args.batches_per_iter / (time.perf_counter() - started)
        print(f"Iter #{iteration}: {rate:.1f} img/sec per GPU")
        rates.append(rate)
    mean, deviation = statistics.mean(rates), statistics.pstdev(rates)
    print(f"Img/sec per GPU: {mean:.1f} +-{1.96 * deviation:.1f}")
    peak = 0
    if not args.cpu:
        peak = tf.config.experimental.get_memory_info("GPU:0")["peak"]
    if runner.is_chief:
        write_report(args.output, {"rates": rates, "peak_bytes": peak})


def launch(strategy: str, precision: str, xla: bool, accumulation: int,
           args: argparse.Namespace) -> dict:
    command = [sys.executable, os.path.abspath(__file__), "--variant", f"--strategy={strategy}",
               f"--precision={precision}", f"--accumulation={accumulation}",
               f"--batch={args.batch}", f"--image={args.image}", f"--iters={args.iters}",
               f"--batches_per_iter={args.batches_per_iter}", f"--model={args.model}",
               *(["--xla"] if xla else []),
               *(["--cpu"] if args.cpu else [])]
    if strategy == "horovod":
        command = [*mpirun(1), *command]
    # The children print Horovod's lines (Iter #..., Img/sec per GPU); they are shown.
    return run_children(command, what=f"gpu: {strategy}/{precision}", echo=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64, help="images per step (per GPU)")
    parser.add_argument("--image", type=int, default=224, help="image side")
    parser.add_argument("--iters", type=int, default=10, help="timed rounds")
    parser.add_argument("--batches_per_iter", type=int, default=10, help="steps per round")
    parser.add_argument("--cpu", action="store_true",
                        help="run on the CPU: a check of the code, not a measurement")
    parser.add_argument("--only", type=int, help="run only the first N variants")
    parser.add_argument("--model", choices=("resnet50", "small"), default="resnet50",
                        help="small: a one-layer CNN, to check the code quickly")
    parser.add_argument("--variant", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--strategy", help=argparse.SUPPRESS)
    parser.add_argument("--precision", help=argparse.SUPPRESS)
    parser.add_argument("--xla", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--accumulation", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--output", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        return run_variant(args)

    import tensorflow as tf

    if not args.cpu and not tf.config.list_physical_devices("GPU"):
        print("gpu: not measured: no GPU (TensorFlow sees none; on a GPU machine: "
              "make setup TF_BUILD=gpu && make bench-gpu)")
        emit("gpu", [], measured=False, reason="no GPU")
        return
    images = {}
    for strategy, precision, xla in variants()[:args.only]:
        key = f"{strategy}/{precision}" + ("/xla" if xla else "")
        images[key] = launch(strategy, precision, xla, 1, args)["rates"]
    figures = [figure(f"images_per_sec_{key.replace('/', '_')}",
                      f"ResNet-50 images/s, {key.replace('/', ', ')}", rates, unit="img/s")
               for key, rates in images.items()]
    baseline = images.get("one_device/float32")
    if baseline:
        figures += [figure(f"speedup_{key.replace('/', '_')}",
                           f"{key.replace('/', ', ')} / one_device float32, images/s",
                           [statistics.median(rates) / statistics.median(baseline)])
                    for key, rates in images.items() if key != "one_device/float32"]
    memory = {}  # the CPU has no peak-memory counter to read
    if not args.cpu:
        memory = {k: launch("one_device", "tf32", False, k, args)["peak_bytes"] for k in (1, 4)}
        figures.append(figure("peak_memory_k4_over_k1",
                              f"peak GPU memory, micro-batch {args.batch // 4} x k=4 / batch "
                              f"{args.batch}", [memory[4] / memory[1]]))
    emit("gpu", figures, measured=not args.cpu, batch=args.batch, image=args.image,
         device=("CPU (a check of the code)" if args.cpu else
                 tf.config.experimental.get_device_details(
                     tf.config.list_physical_devices("GPU")[0]).get("device_name", "GPU")),
         peak_memory_mb={str(k): round(v / 2**20, 1) for k, v in memory.items()})


if __name__ == "__main__":
    main()
