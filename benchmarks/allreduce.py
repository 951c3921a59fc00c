"""All-reduce bandwidth between 2 local processes, beside memcpy bandwidth in the same run.

- ring: TensorFlow's collective RING implementation (gRPC), as `multi_worker` uses
  it with `multi_worker.communication: ring`, between 2 workers started by
  `tfdist launch`.
- horovod: Horovod's `allreduce` (average, one per tensor) between 2 ranks started by
  `mpirun` (MPI) and by `horovodrun --gloo` (Gloo), called directly ("raw") and,
  under MPI, through the `horovod` adapter's gradient synchronisation ("tfdist":
  what `runner.optimizer` runs in each train step), interleaved on the same
  tensors. Also on ResNet-50's 214 gradient tensors (25.6 M parameters, 102 MB),
  which Horovod's fusion buffer batches.
- memcpy: a NumPy copy of the same sizes in the parent process, the ceiling for
  moving bytes on this machine.

Each size is one float32 tensor of 1 to 64 MB. Bandwidth is the size over the
median time of one all-reduce inside a `tf.function` (warm-up excluded).

    .venv/bin/python benchmarks/allreduce.py [--repeats 10]

The last line is JSON: GB/s per size for each column (`series`, with the spread
of each 64 MB figure), and per size the raw Horovod time over the adapter's in the
same round (1.0: no overhead; target >= 0.95).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import statistics
import sys

from method import emit, figure, interleaved
from processes import mpirun, run_children, tfdist_launch, write_report

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

SIZES_MB = (1, 4, 16, 64)


def worker(repeats: int, output: str) -> None:
    """One worker: time all-reduces of each size; the chief reports GB/s."""
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

        seconds = interleaved({"ring": lambda: float(
            strategy.experimental_local_results(all_reduce())[0])}, repeats)["ring"]
        results[str(size_mb)] = [size_mb * 2**20 / s / 1e9 for s in seconds]
    if runner.is_chief:
        write_report(output, results)


def horovod_rank(repeats: int, output: str) -> None:
    """One Horovod rank: raw allreduce against the adapter's, interleaved.

    The chief reports GB/s per size and round for each.
    """
    import horovod.tensorflow as hvd
    import keras
    import tensorflow as tf

    import tfdist

    runner = tfdist.Runner(tfdist.load_config(overrides={"strategy": "horovod"}))
    optimizer = runner.optimizer(keras.optimizers.SGD(0.1))  # a GradientReducingOptimizer
    shapes = {str(size_mb): [[size_mb * 2**20 // 4]] for size_mb in SIZES_MB}
    shapes["resnet50"] = [w.shape for w in keras.applications.ResNet50(weights=None)
                          .trainable_weights]

    def first_elements(reduced):
        return tf.add_n([tf.reshape(t, [-1])[0] for t in reduced])

    # Horovod's own default, as its DistributedOptimizer calls it: one allreduce per tensor,
    # fused by its background thread; the adapter's default does the same.
    raw = tf.function(lambda tensors: first_elements(
        [hvd.allreduce(tensor, op=hvd.Average) for tensor in tensors]))
    adapter = tf.function(lambda tensors: first_elements(optimizer.reduce(tensors)))
    results = {"raw": {}, "tfdist": {}}
    for name, tensor_shapes in shapes.items():
        tensors = [tf.ones(shape, tf.float32) for shape in tensor_shapes]
        megabytes = sum(t.shape.num_elements() for t in tensors) * 4 / 2**20
        # A scalar read back, so the time is the allreduce's and no copy is timed.
        seconds = interleaved({"raw": lambda: float(raw(tensors)),
                               "tfdist": lambda: float(adapter(tensors))}, repeats)
        for column in results:
            results[column][name] = [megabytes * 2**20 / s / 1e9 for s in seconds[column]]
    if runner.is_chief:
        write_report(output, results)


def run_horovod(repeats: int, controller: str) -> dict[str, dict[str, list[float]]] | None:
    """Runs `horovod_rank` on 2 ranks under mpirun ("mpi") or horovodrun --gloo ("gloo").

    Returns None when Horovod or mpirun is missing.
    """
    if shutil.which("mpirun") is None or importlib.util.find_spec("horovod") is None:
        return None
    rank = [sys.executable, os.path.abspath(__file__), "--horovod_rank", f"--repeats={repeats}"]
    if controller == "gloo":
        horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
        launcher = [horovodrun, "--gloo", "-np", "2", "-H", "localhost:2"]
    else:
        launcher = mpirun(2)
    return run_children([*launcher, *rank], what=f"the Horovod ranks ({controller})")


def memcpy_gbps(repeats: int) -> dict[str, list[float]]:
    import numpy as np

    results = {}
    for size_mb in SIZES_MB:
        source = np.ones(size_mb * 2**20 // 4, np.float32)
        target = np.empty_like(source)
        seconds = interleaved({"memcpy": lambda: np.copyto(target, source)}, repeats)["memcpy"]
        results[str(size_mb)] = [size_mb * 2**20 / s / 1e9 for s in seconds]
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--horovod_rank", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=10, help="timed all-reduces per size")
    parser.add_argument("--output", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.repeats, args.output)
        return
    if args.horovod_rank:
        horovod_rank(args.repeats, args.output)
        return
    ring = run_children([*tfdist_launch(2), sys.executable, os.path.abspath(__file__),
                         "--worker", f"--repeats={args.repeats}"], what="the TF RING workers")
    horovod = run_horovod(args.repeats, "mpi")
    gloo = run_horovod(args.repeats, "gloo")
    memcpy = memcpy_gbps(args.repeats)
    columns = {"TF RING": ring, "memcpy": memcpy}
    if horovod:
        columns.update({"Horovod/MPI": horovod["raw"], "Horovod/Gloo": gloo["raw"],
                        "tfdist horovod": horovod["tfdist"]})
    series = {column: {size: statistics.median(gbps) for size, gbps in values.items()}
              for column, values in columns.items()}
    print(f"{'MB':>8} " + " ".join(f"{column:>14}" for column in series) + "   (GB/s)")
    for size in [*ring, *(["resnet50"] if horovod else [])]:
        print(f"{size:>8} " + " ".join(
            f"{values[size]:>14.3f}" if size in values else f"{'':>14}"
            for values in series.values()))
    figures = [figure("ring_64mb_gbps", "TF collective RING (gRPC), 64 MB, 2 processes",
                      ring["64"], unit="GB/s"),
               figure("memcpy_64mb_gbps", "NumPy copy, 64 MB", memcpy["64"], unit="GB/s")]
    if horovod:
        figures += [
            figure("horovod_64mb_gbps", "Horovod allreduce (MPI), 64 MB, 2 ranks",
                   horovod["raw"]["64"], unit="GB/s"),
            figure("gloo_64mb_gbps", "Horovod allreduce (Gloo), 64 MB, 2 ranks",
                   gloo["raw"]["64"], unit="GB/s"),
            *(figure(f"horovod_ratio_{size}", f"horovod adapter / raw Horovod, {size}"
                     f"{' MB' if size != 'resnet50' else ' (214 tensors)'}: raw time / "
                     "adapter time", [ours / raw for raw, ours in zip(horovod["raw"][size],
                                                                      horovod["tfdist"][size])],
                     target=">= 0.95") for size in horovod["raw"])]
    ratios = [f.median for f in figures if f.name.startswith("horovod_ratio_")]
    emit("allreduce", figures, processes=2, repeats=args.repeats,
         series={column: {size: round(v, 4) for size, v in values.items()}
                 for column, values in series.items()},
         **({"horovod_min_ratio": round(min(ratios), 4),
             "horovod_over_ring_64mb": round(series["Horovod/MPI"]["64"]
                                             / series["TF RING"]["64"], 2)} if ratios else {}))


if __name__ == "__main__":
    main()
