"""All-reduce bandwidth between 2 local processes, beside memcpy bandwidth in the same run.

- ring: TensorFlow's collective RING implementation (gRPC), as `multi_worker` uses
  it with `multi_worker.communication: ring`, between 2 workers started by
  `tfdist launch`.
- horovod: Horovod's `grouped_allreduce` (average) between 2 ranks started by
  `mpirun`, called directly ("raw") and through the `horovod` adapter's gradient
  synchronisation ("tfdist": what `runner.optimizer` runs in each train step),
  interleaved on the same tensors. Also on ResNet-50's 214 gradient tensors
  (25.6 M parameters, 102 MB) in one grouped call.
- memcpy: a NumPy copy of the same sizes in the parent process, the ceiling for
  moving bytes on this machine.

Each size is one float32 tensor of 1 to 64 MB. Bandwidth is the size over the
median time of one all-reduce inside a `tf.function` (warm-up excluded).

    .venv/bin/python benchmarks/allreduce.py [--repeats 10]

The last line is JSON: GB/s per size for each column, the tfdist/raw Horovod
time ratios (raw time over tfdist time: 1.0 means no overhead) and their minimum.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

SIZES_MB = (1, 4, 16, 64)


def worker(repeats: int) -> None:
    """One worker: time all-reduces of each size; the chief prints GB/s as JSON."""
    import tensorflow as tf

    import tfdist

    runner = tfdist.Runner(tfdist.load_config(overrides={
        "strategy": "multi_worker", "multi_worker.communication": "ring"}))
    strategy = runner.strategy
    results = {}
    for size_mb in SIZES_MB:
        with strategy.scope():
            tensor = tf.ones([size_mb * 2**20 // 4], tf.float32)

        @tf.function
        def all_reduce():
            def replica_fn():
                summed = tf.distribute.get_replica_context().all_reduce("sum", tensor)
                return summed[0]  # a scalar to wait on, so no copy is timed
            return strategy.run(replica_fn)

        for _ in range(3):  # warm-up: tracing and the collective's first rendezvous
            float(strategy.experimental_local_results(all_reduce())[0])
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            result = all_reduce()
            float(strategy.experimental_local_results(result)[0])
            seconds.append(time.perf_counter() - start)
        results[str(size_mb)] = size_mb * 2**20 / statistics.median(seconds) / 1e9
    if runner.is_chief:
        print(json.dumps({"ring": results}), flush=True)


def horovod_rank(repeats: int) -> None:
    """One Horovod rank: raw grouped_allreduce against the adapter's, interleaved."""
    import horovod.tensorflow as hvd
    import keras
    import tensorflow as tf

    import tfdist

    runner = tfdist.Runner(tfdist.load_config(overrides={"strategy": "horovod"}))
    optimizer = runner.optimizer(keras.optimizers.SGD(0.1))  # a GradientReducingOptimizer
    shapes = {str(size_mb): [[size_mb * 2**20 // 4]] for size_mb in SIZES_MB}
    shapes["resnet50"] = [w.shape for w in keras.applications.ResNet50(weights=None)
                          .trainable_weights]

    def timed(fn, tensors):
        start = time.perf_counter()
        float(fn(tensors))  # a scalar to wait on, so no copy is timed
        return time.perf_counter() - start

    def first_elements(reduced):
        return tf.add_n([tf.reshape(t, [-1])[0] for t in reduced])

    raw = tf.function(lambda tensors: first_elements(hvd.grouped_allreduce(
        tensors, op=hvd.Average)))
    adapter = tf.function(lambda tensors: first_elements(optimizer.reduce(tensors)))
    results = {"raw": {}, "tfdist": {}}
    for name, tensor_shapes in shapes.items():
        tensors = [tf.ones(shape, tf.float32) for shape in tensor_shapes]
        megabytes = sum(t.shape.num_elements() for t in tensors) * 4 / 2**20
        for _ in range(3):  # warm-up: tracing and Horovod's first negotiation
            timed(raw, tensors), timed(adapter, tensors)
        seconds = {"raw": [], "tfdist": []}
        for _ in range(repeats):
            seconds["raw"].append(timed(raw, tensors))
            seconds["tfdist"].append(timed(adapter, tensors))
        for column in results:
            results[column][name] = megabytes * 2**20 / statistics.median(seconds[column]) / 1e9
    if runner.is_chief:
        print(json.dumps({"horovod": results}), flush=True)


def run_horovod(repeats: int) -> dict[str, dict[str, float]] | None:
    """Runs `horovod_rank` on 2 ranks under mpirun; None when Horovod or mpirun is missing."""
    import importlib.util
    import shutil
    import subprocess

    mpirun = shutil.which("mpirun")
    if mpirun is None or importlib.util.find_spec("horovod") is None:
        return None
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []  # Open MPI refuses root unasked
    result = subprocess.run([mpirun, *root, "--oversubscribe", "-np", "2", sys.executable,
                             os.path.abspath(__file__), "--horovod_rank",
                             f"--repeats={repeats}"],
                            capture_output=True, text=True, stdin=subprocess.DEVNULL)
    lines = [line for line in result.stdout.splitlines() if line.startswith('{"horovod"')]
    if result.returncode != 0 or not lines:
        raise SystemExit(f"the Horovod ranks failed:\n{(result.stdout + result.stderr)[-3000:]}")
    return json.loads(lines[-1])["horovod"]


def memcpy_gbps(repeats: int) -> dict[str, float]:
    import numpy as np

    results = {}
    for size_mb in SIZES_MB:
        source = np.ones(size_mb * 2**20 // 4, np.float32)
        target = np.empty_like(source)
        np.copyto(target, source)
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            np.copyto(target, source)
            seconds.append(time.perf_counter() - start)
        results[str(size_mb)] = size_mb * 2**20 / statistics.median(seconds) / 1e9
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--horovod_rank", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=10, help="timed all-reduces per size")
    args = parser.parse_args()
    if args.worker:
        worker(args.repeats)
        return
    if args.horovod_rank:
        horovod_rank(args.repeats)
        return
    from tfdist.app.launch import launch, task_output

    output = io.StringIO()
    status = launch([sys.executable, os.path.abspath(__file__), "--worker",
                     f"--repeats={args.repeats}"], 2, output=output)
    lines = [line for line in task_output(output.getvalue(), "worker:0")
             if line.startswith("{")]
    if status != 0 or not lines:
        raise SystemExit(f"the workers failed:\n{output.getvalue()[-3000:]}")
    ring = json.loads(lines[-1])["ring"]
    horovod = run_horovod(args.repeats)
    memcpy = memcpy_gbps(args.repeats)
    figures = {"benchmark": "allreduce", "processes": 2,
               "ring_gbps": {k: round(v, 3) for k, v in ring.items()},
               "memcpy_gbps": {k: round(v, 2) for k, v in memcpy.items()},
               "ring_64mb_gbps": round(ring["64"], 3),
               "memcpy_64mb_gbps": round(memcpy["64"], 2)}
    print(f"{'MB':>8} {'TF RING':>8} {'Horovod':>8} {'tfdist':>8} {'ratio':>6} {'memcpy':>7}"
          "   (GB/s; ratio: raw Horovod time / tfdist time)")
    for size in [*ring, *(["resnet50"] if horovod else [])]:
        row = f"{size:>8} {ring[size]:>8.3f}" if size in ring else f"{size:>8} {'':>8}"
        if horovod:
            raw, ours = horovod["raw"][size], horovod["tfdist"][size]
            row += f" {raw:>8.3f} {ours:>8.3f} {ours / raw:>6.3f}"
        row += f" {memcpy[size]:>7.2f}" if size in memcpy else ""
        print(row)
    if horovod:
        ratios = {size: round(horovod["tfdist"][size] / horovod["raw"][size], 3)
                  for size in horovod["raw"]}
        figures.update({
            "horovod_raw_gbps": {k: round(v, 3) for k, v in horovod["raw"].items()},
            "horovod_tfdist_gbps": {k: round(v, 3) for k, v in horovod["tfdist"].items()},
            "horovod_ratios": ratios, "horovod_min_ratio": min(ratios.values()),
            "horovod_64mb_gbps": round(horovod["raw"]["64"], 3),
            "horovod_over_ring_64mb": round(horovod["raw"]["64"] / ring["64"], 2)})
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
