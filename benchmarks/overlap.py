"""Whether gradient reduction overlaps the backward pass, on ResNet-50's 214 gradient tensors.

Two processes train ResNet-50 (25.6 M parameters, 214 gradient tensors, 98 MB;
32 x 32 images, the smallest it takes, so that a step fits this machine) with `model.fit`, and each
strategy's two ways of reducing gradients race:

- horovod: one grouped allreduce once every gradient is computed
  (`horovod.grouped: true`) against the default, `grouped: false`: buckets of 25 MB, the
  last layers' first, each one grouped allreduce started as soon as its gradients are
  computed and after the bucket before it (collectives go in one order on every rank,
  `tfdist/horovod/ordering.py`). Both in the same 2 ranks under mpirun: two Runners, two
  models, alternating epochs.
- multi_worker: one pack of all gradients (`multi_worker.bytes_per_pack: 0`)
  against packs of 25 MB (PyTorch DDP's bucket size), each all-reduced when its
  gradients are ready (one pack, TensorFlow's default, stays: three runs here gave
  packs/one pack 1.16, 1.13, 0.78 and 0.91, no consistent difference on 2 cores). A
  strategy is made once per process, so each setting is a `tfdist launch` of its
  own, the settings alternating.

Each figure is the median over epochs after the first of the second setting's
step time over the first's (below 1: the second is faster).

    .venv/bin/python benchmarks/overlap.py [--epochs 4] [--steps 4] [--repeats 1]

The last line is JSON: `horovod_buckets_over_grouped` and
`multi_worker_packed_over_one_pack` (step-time ratios), and the steps per second.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys

from method import emit, figure
from processes import mpirun, run_children, tfdist_launch, write_report

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

IMAGE, BATCH, CLASSES = 32, 4, 1000
PACK_BYTES = 25 * 2**20


def train(runner, epochs: int, steps: int, model_name: str = "resnet50"):
    """The model under `runner`, its dataset and a Throughput timer, ready to fit.

    "small" (two layers) is for checking this benchmark's code quickly, not for measuring.
    """
    import keras
    import numpy as np
    import tensorflow as tf

    from tfdist.callbacks import Throughput

    rng = np.random.default_rng(0)
    global_batch = BATCH * runner.num_replicas
    count = global_batch * steps
    data = tf.data.Dataset.from_tensor_slices(
        (rng.random((count, IMAGE, IMAGE, 3), dtype=np.float32),
         rng.integers(0, CLASSES, count).astype(np.int32)))
    with runner.scope():
        if model_name == "resnet50":
            model = keras.applications.ResNet50(weights=None, input_shape=(IMAGE, IMAGE, 3),
                                                classes=CLASSES)
        else:
            model = keras.Sequential([keras.Input((IMAGE, IMAGE, 3)),
                                      keras.layers.Conv2D(8, 3, activation="relu"),
                                      keras.layers.GlobalAveragePooling2D(),
                                      keras.layers.Dense(CLASSES, activation="softmax")])
        model.compile(optimizer=runner.optimizer(keras.optimizers.SGD(0.01)),
                      loss="sparse_categorical_crossentropy")
    return model, runner.dataset(data, global_batch), Throughput(global_batch)


def horovod_ranks(args: argparse.Namespace) -> None:
    """On each rank: grouped against buckets, alternating epochs; rank 0 writes rates."""
    import tfdist

    runs = {}
    for name, grouped in (("grouped", True), ("buckets", False)):
        runner = tfdist.Runner(tfdist.load_config(overrides={
            "strategy": "horovod", "precision": "float32", "seed": 0,
            "horovod.grouped": grouped}))
        runs[name] = (runner, *train(runner, args.epochs, args.steps, args.model))
    for _ in range(args.epochs):
        for runner, model, dataset, timer in runs.values():
            model.fit(dataset, epochs=1, verbose=0, shuffle=False,
                      callbacks=[*runner.callbacks(), timer])
    if runs["grouped"][0].is_chief:
        write_report(args.output, {name: run[3].epoch_rates[1:] for name, run in runs.items()})


def multi_worker_task(args: argparse.Namespace) -> None:
    """One worker of one setting; the chief writes its epoch rates."""
    import tfdist

    runner = tfdist.Runner(tfdist.load_config(overrides={
        "strategy": "multi_worker", "precision": "float32", "seed": 0,
        "threads.inter_op": 4, "multi_worker.bytes_per_pack": args.bytes_per_pack}))
    model, dataset, timer = train(runner, args.epochs, args.steps, args.model)
    model.fit(dataset, epochs=args.epochs, verbose=0, shuffle=False,
              callbacks=[*runner.callbacks(), timer])
    if runner.is_chief:
        write_report(args.output, timer.epoch_rates[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=4, help="epochs per run (first: warm-up)")
    parser.add_argument("--steps", type=int, default=4, help="steps per epoch")
    parser.add_argument("--repeats", type=int, default=1,
                        help="alternating multi_worker launches per setting")
    parser.add_argument("--model", choices=("resnet50", "small"), default="resnet50",
                        help="small: a two-layer CNN, to check the code quickly")
    parser.add_argument("--role", choices=("horovod", "multi_worker"), help=argparse.SUPPRESS)
    parser.add_argument("--bytes_per_pack", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--output", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "horovod":
        return horovod_ranks(args)
    if args.role == "multi_worker":
        return multi_worker_task(args)

    script = [sys.executable, os.path.abspath(__file__), f"--epochs={args.epochs}",
              f"--steps={args.steps}", f"--model={args.model}"]
    figures, rates = [], {}
    label = "ResNet-50 (214 tensors)" if args.model == "resnet50" else "small CNN"
    if shutil.which("mpirun"):
        horovod = run_children([*mpirun(2), *script, "--role=horovod"],
                               what="overlap: the horovod ranks")
        rates["horovod"] = horovod
        figures.append(figure(
            "horovod_buckets_over_grouped", f"horovod, {label}, 2 ranks: "
            "step time, 25 MB buckets / one grouped allreduce",
            [grouped / buckets for grouped, buckets in zip(horovod["grouped"],
                                                           horovod["buckets"])]))
    packs = {"one_pack": [], "packed": []}
    for _ in range(args.repeats):
        for name, pack in (("one_pack", 0), ("packed", PACK_BYTES)):
            packs[name] += run_children([*tfdist_launch(2), *script, "--role=multi_worker",
                                         f"--bytes_per_pack={pack}"],
                                        what=f"overlap: multi_worker, {name}")
    rates["multi_worker"] = packs
    figures.append(figure(
        "multi_worker_packed_over_one_pack", f"multi_worker, {label}, "
        "2 workers: step time, 25 MB packs / one pack",
        [one / packed for one, packed in zip(packs["one_pack"], packs["packed"])]))
    steps_per_sec = {strategy: {name: statistics.median(values) / (2 * BATCH)
                                for name, values in settings.items()}
                     for strategy, settings in rates.items()}
    for strategy, settings in steps_per_sec.items():
        print(f"{strategy}: " + ", ".join(f"{name} {rate:.3f} steps/s"
                                          for name, rate in settings.items()))
    for f in figures:
        print(f"{f.label}: {f.median:.3f} ({f.low:.3f}-{f.high:.3f})")
    emit("overlap", figures, image=IMAGE, per_worker_batch=BATCH, pack_bytes=PACK_BYTES,
         steps_per_sec={s: {k: round(v, 4) for k, v in d.items()}
                        for s, d in steps_per_sec.items()})


if __name__ == "__main__":
    main()
