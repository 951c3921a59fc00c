"""All-reduce bandwidth between 2 local processes, beside memcpy bandwidth in the same run.

TensorFlow's collective RING implementation (gRPC), as `multi_worker` uses it with
`multi_worker.communication: ring`, summing one float32 tensor of 1 to 64 MB
across 2 workers started by `tfdist launch`. Bandwidth is the tensor's size over
the median time of one all-reduce (warm-up excluded). memcpy is a NumPy copy of
the same sizes in the parent process: the ceiling for moving bytes on this machine.
The Horovod columns are added by the Horovod adapter's issue.

    .venv/bin/python benchmarks/allreduce.py [--repeats 10]

The last line is JSON: GB/s per size for `ring` and `memcpy`, and both at 64 MB.
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
    parser.add_argument("--repeats", type=int, default=10, help="timed all-reduces per size")
    args = parser.parse_args()
    if args.worker:
        worker(args.repeats)
        return
    from tfdist.launch import launch, task_output

    output = io.StringIO()
    status = launch([sys.executable, os.path.abspath(__file__), "--worker",
                     f"--repeats={args.repeats}"], 2, output=output)
    lines = [line for line in task_output(output.getvalue(), "worker:0")
             if line.startswith("{")]
    if status != 0 or not lines:
        raise SystemExit(f"the workers failed:\n{output.getvalue()[-3000:]}")
    ring = json.loads(lines[-1])["ring"]
    memcpy = memcpy_gbps(args.repeats)
    print(f"{'MB':>4} {'TF RING GB/s':>13} {'memcpy GB/s':>12}")
    for size in ring:
        print(f"{size:>4} {ring[size]:>13.3f} {memcpy[size]:>12.2f}")
    print(json.dumps({"benchmark": "allreduce", "processes": 2,
                      "ring_gbps": {k: round(v, 3) for k, v in ring.items()},
                      "memcpy_gbps": {k: round(v, 2) for k, v in memcpy.items()},
                      "ring_64mb_gbps": round(ring["64"], 3),
                      "memcpy_64mb_gbps": round(memcpy["64"], 2)}))


if __name__ == "__main__":
    main()
