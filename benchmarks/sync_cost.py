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

The cost model (ring_model.py) is the ring all-reduce's, 2(N-1)/N x S / B + 2(N-1) x a
for S bytes on N replicas, plus what a list of tensors costs beyond one tensor (a copy
of its pack where the implementation makes one, an op per tensor), with a bandwidth
that falls once at a fitted size. In the same run each strategy's reduction is timed
on calibration runs: single tensors of 1/32 to 128 MB, lists of 4 tensors and a
10-element bias of 2 to 64 MB in all, and 16 and 64 tensors of 4 KB; the model is
fitted to those (least squares on relative error) and predicts the three gradient
sets, none of which it was fitted on. Target: within 25%.

In the processes of `multi_worker` and `horovod`, a barrier (an all-reduce of one
number, untimed) precedes every timed call, so that no call is timed while waiting
for the other process to finish the previous one.

    .venv/bin/python benchmarks/sync_cost.py [--repeats 15]

The last line is JSON: per strategy and size the tfdist/raw ratio, the measured and
predicted milliseconds, the fitted constants, and each calibration run against its fit.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import sys

import numpy as np

from method import emit, figure, interleaved, rounded
from processes import mpirun, run_children, tfdist_launch, write_report
from ring_model import REPLICAS, fit_ring_model, pack_is_copied, predict

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

# Dense layer widths, input first: gradients of about 0.1, 10 and 100 MB (weights and biases).
MODELS = {"0.1": (100, 128, 64, 10), "10": (1024, 1024, 1024, 512, 10),
          "100": (4096, 4096, 2048, 1024, 10)}
# Single-tensor calibration sizes: dense enough on both sides of where the bandwidth
# falls (near the last-level cache for MPI, 64-96 MB for gRPC here) to place the fall.
FIT_MB = (1 / 32, 1 / 4, 1, 2, 4, 8, 24, 32, 48, 64, 96, 128)
# Lists of 4 tensors and a 10-element bias (a classifier's) of 2 to 64 MB in all: what
# a pack's copy costs (the 40 bytes make TensorFlow copy its pack, see `pack_is_copied`).
PACKED, PACKED_MB, BIAS = 4, (2, 8, 32, 64), 10
COUNTS, SMALL_TENSOR = (16, 64), 1024  # many 4 KB tensors, for the per-tensor cost
STRATEGIES = ("mirrored", "multi_worker", "horovod")


def describe(elements: list[int]) -> str:
    """A calibration run's name: "4x131072+10" is 4 tensors of 131072 elements and one of 10."""
    parts, index = [], 0
    while index < len(elements):
        run = 1
        while index + run < len(elements) and elements[index + run] == elements[index]:
            run += 1
        parts.append(f"{run}x{elements[index]}" if run > 1 else str(elements[index]))
        index += run
    return "+".join(parts)


def gradient_shapes(widths: tuple[int, ...]) -> list[list[int]]:
    """The shapes of an MLP's gradients: a kernel and a bias per Dense layer."""
    shapes = []
    for inputs, outputs in zip(widths, widths[1:]):
        shapes += [[inputs, outputs], [outputs]]
    return shapes


def timings(strategy_name: str, reduce_list, reduce_flat, args: argparse.Namespace,
            barrier=None) -> dict:
    """Times the calibration runs and each model's tfdist and raw reductions, interleaved.

    Every run is timed once per round, all rounds alike, so the calibration the model
    is fitted on and the measurements it predicts see the same machine.

    Args:
        strategy_name: Which strategy the caller set up.
        reduce_list: A function of a list of shapes that returns a call running the
            tfdist reduction of such gradients once.
        reduce_flat: The same for the raw collective on one flat tensor of n elements.
        args: The command line.
        barrier: A call that returns once every process has reached it (None: one
            process), run untimed before each timed call.

    Returns:
        {"sweep": {bytes: [seconds]} of the raw collective,
         "calibration": {name: {"elements": [per tensor], "seconds": [...]}} of the
             tfdist reduction,
         "models": {name: {"elements": [per tensor], "raw": [seconds], "tfdist": [seconds]}}}
    """
    runs, sweep_keys, calibration, models = {}, {}, {}, {}
    lists = [[int(megabytes * 2**20) // 4] for megabytes in args.fit_mb]
    lists += [[int(megabytes * 2**20) // 4 // PACKED] * PACKED + [BIAS]
              for megabytes in args.packed_mb]
    # Many 4 KB tensors: the cost of each tensor apart from its bytes.
    lists += [[SMALL_TENSOR] * count for count in COUNTS]
    for elements in lists:
        if len(elements) == 1:
            runs[f"raw {elements[0]}"] = reduce_flat(elements[0])
            sweep_keys[elements[0] * 4] = f"raw {elements[0]}"
        calibration[describe(elements)] = {"elements": elements}
        runs[describe(elements)] = reduce_list([[count] for count in elements])
    for name in args.models:
        shapes = gradient_shapes(MODELS[name])
        elements = [int(np.prod(shape)) for shape in shapes]
        runs[f"raw {name}"] = reduce_flat(sum(elements))
        runs[f"tfdist {name}"] = reduce_list(shapes)
        models[name] = {"elements": elements}
    seconds = interleaved(runs, args.repeats, before=barrier)
    for name, model in models.items():
        model.update(raw=seconds[f"raw {name}"], tfdist=seconds[f"tfdist {name}"])
    for name, run in calibration.items():
        run["seconds"] = seconds[name]
    return {"strategy": strategy_name,
            "sweep": {size: seconds[key] for size, key in sweep_keys.items()},
            "calibration": calibration, "models": models}


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
        barrier = None  # one process
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
        barrier = reduce_flat(1)
    return timings(args.role, reduce_list, reduce_flat, args, barrier)


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

    return timings("horovod", reduce_list, reduce_flat, args, barrier=reduce_flat(1))


def measure(strategy_name: str, args: argparse.Namespace) -> dict:
    """Runs one strategy's role in its own process(es); returns the first replica's timings."""
    launcher = []  # mirrored: one process
    if strategy_name == "multi_worker":
        launcher = tfdist_launch(REPLICAS)
    elif strategy_name == "horovod":
        launcher = mpirun(REPLICAS)
    return run_children([*launcher, sys.executable,
                         os.path.abspath(__file__), f"--role={strategy_name}",
                         f"--repeats={args.repeats}",
                         *(f"--models={name}" for name in args.models),
                         *(f"--fit_mb={mb}" for mb in args.fit_mb),
                         *(f"--packed_mb={mb}" for mb in args.packed_mb)],
                        what=f"sync_cost: {strategy_name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=15, help="timed rounds (every run once "
                        "per round)")
    parser.add_argument("--models", action="append", choices=sorted(MODELS),
                        help="gradient sets by MB (default: all)")
    parser.add_argument("--fit_mb", action="append", type=float,
                        help="single-tensor sizes the model is fitted on (default: 1/32 to 128 MB)")
    parser.add_argument("--packed_mb", action="append", type=float,
                        help=f"lists of {PACKED} tensors and a bias the model is fitted on, "
                             f"by MB in all (default: {', '.join(map(str, PACKED_MB))})")
    parser.add_argument("--strategies", action="append", choices=STRATEGIES,
                        help="default: all three (horovod only where Open MPI and Horovod are)")
    parser.add_argument("--role", choices=STRATEGIES, help=argparse.SUPPRESS)
    parser.add_argument("--output", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.models = args.models or list(MODELS)
    args.fit_mb = args.fit_mb or list(FIT_MB)
    args.packed_mb = args.packed_mb or list(PACKED_MB)
    if args.role:
        results = horovod_role(args) if args.role == "horovod" else tf_distribute_role(args)
        if _replica_index(args.role) == 0:
            write_report(args.output, results)
        return

    import importlib.util

    strategies = args.strategies or [
        s for s in STRATEGIES if s != "horovod"
        or (shutil.which("mpirun") and importlib.util.find_spec("horovod"))]
    from tfdist.cluster import detect_cluster

    cache_bytes = detect_cluster(probe_gpus=False).cpu_cache_bytes
    figures, table, fits, sweeps, calibration = [], {}, {}, {}, {}
    for strategy_name in strategies:
        result = measure(strategy_name, args)
        model_fit = fit_ring_model(
            [(4.0 * sum(run["elements"]), len(run["elements"]),
              pack_is_copied(strategy_name, run["elements"]), statistics.median(run["seconds"]))
             for run in result["calibration"].values()])
        fits[strategy_name] = {"bandwidth_small_gbps": model_fit.bandwidth_small / 1e9,
                               "bandwidth_large_gbps": model_fit.bandwidth_large / 1e9,
                               "switch_mb": model_fit.switch_bytes / 2**20,
                               "latency_us": model_fit.latency * 1e6,
                               "pack_gbps": model_fit.pack_bandwidth / 1e9,
                               "per_tensor_us": model_fit.per_tensor * 1e6}
        calibration[strategy_name] = {  # how well the fit fits its own data
            key: {"ms": statistics.median(run["seconds"]) * 1e3,
                  "model_ms": predict(model_fit, strategy_name, run["elements"]) * 1e3}
            for key, run in result["calibration"].items()}
        sweeps[strategy_name] = {int(size): statistics.median(seconds) * 1e3
                                 for size, seconds in result["sweep"].items()}
        for name, model in result["models"].items():
            size, tensors = 4 * sum(model["elements"]), len(model["elements"])
            predicted = predict(model_fit, strategy_name, model["elements"])
            measured = statistics.median(model["tfdist"])
            what = f"{strategy_name}, {size / 2**20:.3g} MB in {tensors} tensors"
            figures += [
                figure(f"{strategy_name}_{name}mb_ratio", f"{what}: tfdist / raw collective, time",
                       [ours / raw for raw, ours in zip(model["raw"], model["tfdist"])],
                       target="<= 1.1"),
                figure(f"{strategy_name}_{name}mb_model_error",
                       f"{what}: ring model's error, abs(predicted / measured - 1)",
                       [abs(predicted / measured - 1)], target="<= 0.25")]
            table[f"{strategy_name}_{name}"] = {
                "megabytes": size / 2**20, "tensors": tensors, "tfdist_ms": measured * 1e3,
                "raw_ms": statistics.median(model["raw"]) * 1e3, "model_ms": predicted * 1e3}
    errors = [f.median for f in figures if f.name.endswith("_model_error")]
    figures.append(figure("model_worst_error", f"ring model's largest error over the {len(errors)} "
                          "syncs above, abs(predicted / measured - 1)", [max(errors)],
                          target="<= 0.25"))
    print(f"{'strategy':<13} {'MB':>6} {'tensors':>7} {'tfdist ms':>10} {'raw ms':>8} "
          f"{'ratio':>6} {'model ms':>9} {'error':>6}")
    for key, row in table.items():
        print(f"{key.rsplit('_', 1)[0]:<13} {row['megabytes']:>6.2f} {row['tensors']:>7} "
              f"{row['tfdist_ms']:>10.2f} {row['raw_ms']:>8.2f} "
              f"{row['tfdist_ms'] / row['raw_ms']:>6.3f} {row['model_ms']:>9.2f} "
              f"{row['model_ms'] / row['tfdist_ms'] - 1:>+6.0%}")
    for strategy_name, fit in fits.items():
        print(f"{strategy_name}: fitted B = {fit['bandwidth_small_gbps']:.3f} GB/s up to "
              f"{fit['switch_mb']:.3g} MB, {fit['bandwidth_large_gbps']:.3f} GB/s beyond, "
              f"a = {fit['latency_us']:.0f} us, P = {fit['pack_gbps']:.3g} GB/s, "
              f"t = {fit['per_tensor_us']:.0f} us per tensor")
        print("  calibration (elements per tensor: measured / model ms): " + ", ".join(
            f"{key}: {row['ms']:.2f} / {row['model_ms']:.2f}"
            for key, row in calibration[strategy_name].items()))
        print("  raw collective (MB: ms): " + ", ".join(
            f"{size / 2**20:.3g}: {ms:.2f}" for size, ms in sweeps[strategy_name].items()))
    emit("sync_cost", figures, replicas=REPLICAS, repeats=args.repeats, cache_bytes=cache_bytes,
         fit={name: {key: json_number(value) for key, value in fit.items()}
              for name, fit in fits.items()},
         calibration={name: {key: {k: rounded(v) for k, v in row.items()}
                             for key, row in rows.items()}
                      for name, rows in calibration.items()},
         sweep_ms={name: {str(size): rounded(ms) for size, ms in sweep.items()}
                   for name, sweep in sweeps.items()},
         table={key: {k: rounded(v) for k, v in row.items()} for key, row in table.items()})


def json_number(value: float) -> float | None:
    """`value` rounded for JSON; None for a term the fit found none of (infinite)."""
    return rounded(value) if math.isfinite(value) else None


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
