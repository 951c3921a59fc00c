"""Synchronisation cost per training step, against the raw collective and a ring cost model.

For each synchronous strategy, on 2 replicas (`mirrored`: 2 logical CPU devices in
one process; `multi_worker`: 2 processes under `tfdist launch`; `horovod`: 2 ranks
under `mpirun`), and for gradients shaped like three MLPs' (about 0.1, 10 and
100 MB of float32), the time of the gradient reduction a training step runs:

- tfdist: what the step calls under the strategy tfdist built. Under `mirrored`
  and `multi_worker`, Keras's optimizer's `replica_context.all_reduce(SUM, grads)`
  on the model's gradient list; under `horovod`, the adapter's reduction
  (`runner.optimizer(...).reduce`);
- raw: the collective on one flat tensor of the same bytes, called directly:
  TensorFlow's `all_reduce_v2` collective op (`multi_worker`), Horovod's
  `allreduce` (`horovod`), the strategy's cross-device all-reduce (`mirrored`).

Both run inside a `tf.function`, alternately, warm-up excluded; the figure is the
median over rounds of tfdist's time over raw's (target <= 1.1).

The cost model is the ring all-reduce's, T(S) = 2(N-1)/N x S / B + 2(N-1) x a for S
bytes on N replicas, with a per-tensor term and, between local processes, two
bandwidths (see `RingModel`). In the same run each strategy's reduction is timed on
calibration runs, single tensors of 1/32 to 128 MB and 16 and 64 tensors of 4 KB;
the model is fitted to those (least squares on relative error) and predicts the
three gradient sets, none of which it was fitted on. Target: within 25%.

    .venv/bin/python benchmarks/sync_cost.py [--repeats 15]

The last line is JSON: per strategy and size the tfdist/raw ratio, the measured and
predicted milliseconds, and the fitted bandwidth (GB/s) and latency (us).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

import numpy as np

from method import emit, figure, interleaved

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

REPLICAS = 2
# Dense layer widths, input first: gradients of about 0.1, 10 and 100 MB (weights and biases).
MODELS = {"0.1": (100, 128, 64, 10), "10": (1024, 1024, 1024, 512, 10),
          "100": (4096, 4096, 2048, 1024, 10)}
# Single-tensor calibration sizes, clear of the cache line (2S = LLC: 16 MB on a 32 MB
# cache), where the bandwidth is neither one nor the other.
FIT_MB = (1 / 32, 1 / 4, 2, 8, 64, 128)
COUNTS, SMALL_TENSOR = (16, 64), 1024  # many 4 KB tensors, for the per-tensor cost
STRATEGIES = ("mirrored", "multi_worker", "horovod")


def gradient_shapes(widths: tuple[int, ...]) -> list[list[int]]:
    """The shapes of an MLP's gradients: a kernel and a bias per Dense layer."""
    shapes = []
    for inputs, outputs in zip(widths, widths[1:]):
        shapes += [[inputs, outputs], [outputs]]
    return shapes


def timings(strategy_name: str, reduce_list, reduce_flat, args: argparse.Namespace) -> dict:
    """Times the calibration runs and each model's tfdist and raw reductions, interleaved.

    Every run is timed once per round, all rounds alike, so the calibration the model
    is fitted on and the measurements it predicts see the same machine.

    Args:
        strategy_name: Which strategy the caller set up.
        reduce_list: A function of a list of shapes that returns a call running the
            tfdist reduction of such gradients once.
        reduce_flat: The same for the raw collective on one flat tensor of n elements.
        args: The command line.

    Returns:
        {"sweep": {bytes: [seconds]} of the raw collective,
         "calibration": {"<tensors>x<elements>": [seconds]} of the tfdist reduction,
         "models": {name: {"bytes", "tensors", "raw": [seconds], "tfdist": [seconds]}}}
    """
    runs, sweep_keys, models = {}, {}, {}
    for megabytes in args.fit_mb:
        elements = int(megabytes * 2**20) // 4
        runs[f"raw 1x{elements}"] = reduce_flat(elements)
        runs[f"1x{elements}"] = reduce_list([[elements]])
        sweep_keys[elements * 4] = f"raw 1x{elements}"
    for count in COUNTS:  # many small tensors: the cost of each tensor apart from its bytes
        runs[f"{count}x{SMALL_TENSOR}"] = reduce_list([[SMALL_TENSOR]] * count)
    for name in args.models:
        shapes = gradient_shapes(MODELS[name])
        elements = sum(int(np.prod(shape)) for shape in shapes)
        runs[f"raw {name}"] = reduce_flat(elements)
        runs[f"tfdist {name}"] = reduce_list(shapes)
        models[name] = {"bytes": elements * 4, "tensors": len(shapes)}
    seconds = interleaved(runs, args.repeats)
    for name, model in models.items():
        model.update(raw=seconds[f"raw {name}"], tfdist=seconds[f"tfdist {name}"])
    return {"strategy": strategy_name,
            "sweep": {size: seconds[key] for size, key in sweep_keys.items()},
            "calibration": {key: values for key, values in seconds.items()
                            if not key.startswith(("raw ", "tfdist "))},
            "models": models}


def first_elements(tensors) -> object:
    """A scalar that depends on every reduced tensor: read back, it waits for all of them
    without copying them out."""
    import tensorflow as tf

    return tf.add_n([tf.reshape(t, [-1])[0] for t in tensors])


def tf_distribute_role(args: argparse.Namespace) -> dict:
    """`mirrored` (2 logical CPUs) or `multi_worker` (one replica per process)."""
    import tensorflow as tf

    import tfdist

    overrides = {"strategy": args.role, "precision": "float32"}
    if args.role == "mirrored":
        overrides["mirrored.cpu_replicas"] = REPLICAS
    runner = tfdist.Runner(tfdist.load_config(overrides=overrides))
    strategy = runner.strategy

    def per_replica(shapes):
        return strategy.experimental_distribute_values_from_function(
            lambda _: [tf.ones(shape, tf.float32) for shape in shapes])

    def run(replica_fn, values):
        def placed(tensors):  # on the replica's device, as gradients computed in the step are
            return replica_fn([tf.identity(t) for t in tensors])
        step = tf.function(lambda values: strategy.run(placed, args=(values,)))
        return lambda: float(strategy.experimental_local_results(step(values))[0])

    def keras_reduction(tensors):  # what Keras's optimizer runs in the train step
        return first_elements(tf.distribute.get_replica_context().all_reduce(
            tf.distribute.ReduceOp.SUM, tensors))

    def reduce_list(shapes):
        return run(keras_reduction, per_replica(shapes))

    if args.role == "mirrored":
        def reduce_flat(elements):
            return run(keras_reduction, per_replica([[elements]]))
    else:
        from tensorflow.python.ops import collective_ops

        keys = iter(range(1, 10**6))  # one instance key per traced collective

        def reduce_flat(elements):
            instance_key = next(keys)

            def collective(tensors):
                return first_elements([collective_ops.all_reduce_v2(
                    tensors[0], group_size=REPLICAS, group_key=100, instance_key=instance_key,
                    communication_hint="ring")])
            return run(collective, per_replica([[elements]]))
    return timings(args.role, reduce_list, reduce_flat, args)


def horovod_role(args: argparse.Namespace) -> dict:
    import horovod.tensorflow as hvd
    import keras
    import tensorflow as tf

    import tfdist

    runner = tfdist.Runner(tfdist.load_config(overrides={"strategy": "horovod",
                                                         "precision": "float32"}))
    optimizer = runner.optimizer(keras.optimizers.SGD(0.1))  # the adapter's reduction

    def reduce_list(shapes):
        tensors = [tf.ones(shape, tf.float32) for shape in shapes]
        step = tf.function(lambda tensors: first_elements(optimizer.reduce(tensors)))
        return lambda: float(step(tensors))

    def reduce_flat(elements):
        tensor = tf.ones([elements], tf.float32)
        step = tf.function(lambda tensor: first_elements([hvd.allreduce(tensor, op=hvd.Average)]))
        return lambda: float(step(tensor))

    return timings("horovod", reduce_list, reduce_flat, args)


def measure(strategy_name: str, args: argparse.Namespace) -> dict:
    """Runs one strategy's role in its own process(es); returns the first replica's timings."""
    folder = tempfile.mkdtemp(prefix="tfdist-sync-cost-")
    role = [sys.executable, os.path.abspath(__file__), f"--role={strategy_name}",
            f"--output={folder}", f"--repeats={args.repeats}",
            *(f"--models={name}" for name in args.models),
            *(f"--fit_mb={mb}" for mb in args.fit_mb)]
    if strategy_name == "multi_worker":
        command = [os.path.join(os.path.dirname(sys.executable), "tfdist"), "launch", "-n",
                   str(REPLICAS), "--", *role]
    elif strategy_name == "horovod":
        root = ["--allow-run-as-root"] if os.geteuid() == 0 else []  # Open MPI refuses root unasked
        command = [shutil.which("mpirun"), *root, "--oversubscribe", "-np", str(REPLICAS), *role]
    else:
        command = role
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=280,
                                stdin=subprocess.DEVNULL,
                                env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
        report = os.path.join(folder, "replica0.json")  # the first replica's own file
        if result.returncode or not os.path.exists(report):
            raise SystemExit(f"sync_cost: {strategy_name} failed:\n"
                             f"{(result.stdout + result.stderr)[-3000:]}")
        with open(report) as stream:
            return json.load(stream)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@dataclasses.dataclass(frozen=True)
class RingModel:
    """The ring all-reduce's cost, with a per-tensor term and the local link's two bandwidths.

        T(S, n) = 2(N-1)/N x S / B(S) + 2(N-1) x a + (n - 1) x t

    for S bytes in n tensors on N replicas. The ring's terms are the textbook ones;
    the per-tensor term t is what a gradient list costs beyond one buffer of the same
    bytes (packing into one buffer and out, Horovod's fusion buffer, an op per
    tensor), which dominates small models. Between processes on one machine the link
    is the memory system, whose bandwidth falls once a message and its result no
    longer fit in the last-level cache: B(S) = B_cache if 2S <= LLC, else B_memory.

    Attributes:
        bandwidth_cache: B for messages that fit in the cache (bytes/s).
        bandwidth_memory: B for larger ones (bytes/s).
        latency: a, per step of the ring (s); with N = 2 it also holds the call's fixed cost.
        per_tensor: t (s).
        cache_bytes: The last-level cache's size (0: unknown; one bandwidth for all sizes).
    """

    bandwidth_cache: float
    bandwidth_memory: float
    latency: float
    per_tensor: float
    cache_bytes: int

    def fits_in_cache(self, size_bytes: float) -> bool:
        return not self.cache_bytes or 2 * size_bytes <= self.cache_bytes

    def seconds(self, size_bytes: float, tensors: int = 1, replicas: int = REPLICAS) -> float:
        """T(S, n) on N replicas."""
        bandwidth = (self.bandwidth_cache if self.fits_in_cache(size_bytes)
                     else self.bandwidth_memory)
        return (ring_seconds(size_bytes, bandwidth, self.latency, replicas)
                + (tensors - 1) * self.per_tensor)


def ring_seconds(size_bytes: float, bandwidth: float, latency: float,
                 replicas: int = REPLICAS) -> float:
    """The ring all-reduce's time: 2(N-1)/N x S / B + 2(N-1) x a."""
    return 2 * (replicas - 1) / replicas * size_bytes / bandwidth + 2 * (replicas - 1) * latency


def fit_ring_model(calibration: dict[str, list[float]], cache_bytes: int,
                   replicas: int = REPLICAS) -> RingModel:
    """Fits the RingModel to the median time of each calibration run.

    Least squares on relative error: the model is linear in 1/B_cache, 1/B_memory,
    a and t, and dividing each row by its measured time weighs every run alike, so
    the small ones (where latency shows) count as much as the large ones. A side of
    the cache line with no run takes the other side's bandwidth.

    Args:
        calibration: "<tensors>x<elements per tensor>" -> seconds of each timed call.
        cache_bytes: The last-level cache's size; 0: one bandwidth.
        replicas: N.
    """
    runs = [tuple(int(part) for part in key.split("x")) for key in calibration]
    sizes = np.array([4.0 * count * elements for count, elements in runs])
    counts = np.array([float(count) for count, _ in runs])
    times = np.array([statistics.median(seconds) for seconds in calibration.values()])
    steps = 2 * (replicas - 1)
    in_cache = np.array([not cache_bytes or 2 * size <= cache_bytes for size in sizes])
    columns = [steps / replicas * sizes * in_cache, steps / replicas * sizes * ~in_cache,
               steps * np.ones_like(sizes), counts - 1]
    used = [column.any() for column in columns]
    design = np.stack([column for column, use in zip(columns, used) if use], axis=1)
    solution = iter(np.linalg.lstsq(design / times[:, None], np.ones_like(times),
                                    rcond=None)[0])
    inverse_cache, inverse_memory, latency, per_tensor = (
        float(next(solution)) if use else None for use in used)
    inverse_cache = inverse_cache if inverse_cache is not None else inverse_memory
    inverse_memory = inverse_memory if inverse_memory is not None else inverse_cache
    return RingModel(bandwidth_cache=1 / inverse_cache, bandwidth_memory=1 / inverse_memory,
                     latency=max(latency, 0.0), per_tensor=max(per_tensor or 0.0, 0.0),
                     cache_bytes=cache_bytes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=15, help="timed rounds (every run once "
                        "per round)")
    parser.add_argument("--models", action="append", choices=sorted(MODELS),
                        help="gradient sets by MB (default: all)")
    parser.add_argument("--fit_mb", action="append", type=float,
                        help="single-tensor sizes the model is fitted on (default: 1/32 to 128 MB)")
    parser.add_argument("--strategies", action="append", choices=STRATEGIES,
                        help="default: all three (horovod only where Open MPI and Horovod are)")
    parser.add_argument("--role", choices=STRATEGIES, help=argparse.SUPPRESS)
    parser.add_argument("--output", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.models = args.models or list(MODELS)
    args.fit_mb = args.fit_mb or list(FIT_MB)
    if args.role:
        results = horovod_role(args) if args.role == "horovod" else tf_distribute_role(args)
        replica = _replica_index(args.role)
        with open(os.path.join(args.output, f"replica{replica}.json"), "w") as stream:
            json.dump(results, stream)
        return

    import importlib.util

    strategies = args.strategies or [
        s for s in STRATEGIES if s != "horovod"
        or (shutil.which("mpirun") and importlib.util.find_spec("horovod"))]
    from tfdist.cluster import detect_cluster

    cache_bytes = detect_cluster(probe_gpus=False).cpu_cache_bytes
    figures, table, fits, sweeps = [], {}, {}, {}
    for strategy_name in strategies:
        result = measure(strategy_name, args)
        model_fit = fit_ring_model(result["calibration"], cache_bytes)
        fits[strategy_name] = {"bandwidth_cache_gbps": model_fit.bandwidth_cache / 1e9,
                               "bandwidth_memory_gbps": model_fit.bandwidth_memory / 1e9,
                               "latency_us": model_fit.latency * 1e6,
                               "per_tensor_us": model_fit.per_tensor * 1e6}
        sweeps[strategy_name] = {int(size): statistics.median(seconds) * 1e3
                                 for size, seconds in result["sweep"].items()}
        for name, model in result["models"].items():
            predicted = model_fit.seconds(model["bytes"], model["tensors"])
            ratio = figure(f"{strategy_name}_{name}mb_ratio",
                           f"{strategy_name}, {model['bytes'] / 2**20:.3g} MB in "
                           f"{model['tensors']} tensors: tfdist / raw collective, time",
                           [ours / raw for raw, ours in zip(model["raw"], model["tfdist"])],
                           target="<= 1.1")
            error = figure(f"{strategy_name}_{name}mb_model_error",
                           f"{strategy_name}, {model['bytes'] / 2**20:.3g} MB: ring model's "
                           "error, abs(predicted / measured - 1)", [abs(predicted / statistics.median(model["tfdist"])
                                                 - 1)], target="<= 0.25")
            figures += [ratio, error]
            table[f"{strategy_name}_{name}"] = {
                "megabytes": model["bytes"] / 2**20, "tensors": model["tensors"],
                "tfdist_ms": statistics.median(model["tfdist"]) * 1e3,
                "raw_ms": statistics.median(model["raw"]) * 1e3, "model_ms": predicted * 1e3}
    print(f"{'strategy':<13} {'MB':>6} {'tensors':>7} {'tfdist ms':>10} {'raw ms':>8} "
          f"{'ratio':>6} {'model ms':>9} {'error':>6}")
    for key, row in table.items():
        strategy_name = key.rsplit("_", 1)[0]
        print(f"{strategy_name:<13} {row['megabytes']:>6.2f} {row['tensors']:>7} "
              f"{row['tfdist_ms']:>10.2f} {row['raw_ms']:>8.2f} "
              f"{row['tfdist_ms'] / row['raw_ms']:>6.3f} {row['model_ms']:>9.2f} "
              f"{row['model_ms'] / row['tfdist_ms'] - 1:>+6.0%}")
    for strategy_name, fit in fits.items():
        print(f"{strategy_name}: fitted ring model B = {fit['bandwidth_cache_gbps']:.3f} GB/s "
              f"in cache, {fit['bandwidth_memory_gbps']:.3f} GB/s beyond, "
              f"a = {fit['latency_us']:.0f} us, t = {fit['per_tensor_us']:.0f} us per tensor; raw collective (MB: ms) " + ", ".join(
                  f"{size / 2**20:.3g}: {ms:.2f}" for size, ms in sweeps[strategy_name].items()))
    emit("sync_cost", figures, replicas=REPLICAS, repeats=args.repeats, cache_bytes=cache_bytes,
         fit={name: {k: round(v, 4) for k, v in fit.items()} for name, fit in fits.items()},
         sweep_ms={name: {str(size): round(ms, 4) for size, ms in sweep.items()}
                   for name, sweep in sweeps.items()},
         table={key: {k: round(v, 4) for k, v in row.items()} for key, row in table.items()})


def _replica_index(role: str) -> int:
    """This process's replica: its task index (multi_worker), rank (horovod), or 0."""
    from tfdist.cluster import detect_cluster

    info = detect_cluster(probe_gpus=False)
    if role == "multi_worker":
        return info.tf_config.task_index
    if role == "horovod":
        return info.mpi.rank if info.mpi else 0
    return 0


if __name__ == "__main__":
    main()
