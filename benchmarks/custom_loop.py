"""Horovod's own custom training loop against the `horovod` adapter's `model.fit`, same model.

Two ranks under mpirun. In each round every rank runs, one after the other:

- Horovod's `examples/tensorflow2/tensorflow2_synthetic_benchmark.py` (tests/ported,
  verbatim from Horovod 0.28.1) with the changes its test applies: the import line
  (`tfdist.horovod.tensorflow`), `opt.variables` (Keras 3), and 32 x 32 images so that
  ResNet-50 fits this machine. It runs once (its own warm-up), then its traced
  `benchmark_step` (`hvd.DistributedGradientTape`, SGD(0.01), one fixed batch) is timed
  each round as the example times it (`timeit`, `--num-batches-per-iter` steps);
- the same ResNet-50, SGD(0.01), loss and batch trained by `model.fit` under
  `strategy: horovod` (`runner.optimizer`, `runner.dataset` over the same fixed batch,
  `runner.callbacks`), one epoch per round of one step more than the loop times: its steps
  after the first are timed (a fit's start, where rank 0's state is broadcast and the
  iterator made, is not a step), its first epoch left out.

The figure is the median over rounds of the fit's images per second per rank over the
custom loop's (1: the adapter costs nothing over Horovod's own loop; below 1: slower).

    .venv/bin/python benchmarks/custom_loop.py [--rounds 3] [--batch 8] [--steps 5] [--model M]

The last line is JSON: `fit_over_custom_loop` and both rates.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import runpy
import statistics
import sys
import time
import timeit

import keras

from method import emit, figure
from processes import mpirun, run_children, write_report

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

IMAGE = 32


def custom_loop_step(script: str, args: argparse.Namespace):
    """Runs Horovod's example once in this process (its warm-up and one timed iteration);
    returns its traced `benchmark_step`, to time again round after round as it times it."""
    sys.argv = [script, "--no-cuda", f"--model={args.model}", f"--batch-size={args.batch}",
                "--num-warmup-batches=2", f"--num-batches-per-iter={args.steps}",
                "--num-iters=1"]
    with contextlib.redirect_stdout(io.StringIO()):  # rank 0's log lines
        return runpy.run_path(script, run_name="__main__")["benchmark_step"]


def fit_model(runner, name: str, batch: int, steps: int):
    """The model under `runner` as the example builds it, and its dataset of one fixed batch."""
    import tensorflow as tf

    data = tf.random.uniform([batch, IMAGE, IMAGE, 3])
    target = tf.random.uniform([batch, 1], minval=0, maxval=999, dtype=tf.int64)
    with runner.scope():
        model = getattr(keras.applications, name)(weights=None, input_shape=(IMAGE, IMAGE, 3))
        model.compile(optimizer=runner.optimizer(keras.optimizers.SGD(0.01)),
                      loss="sparse_categorical_crossentropy")
    # runner.dataset batches per replica: the global batch is batch x ranks.
    global_batch = batch * runner.num_replicas
    examples = tf.data.Dataset.from_tensors((data[0], target[0])).repeat(global_batch * steps)
    return model, runner.dataset(examples, global_batch)


class StepTimes(keras.callbacks.Callback):
    """When each step of the last epoch ended: the steps after the first are timed, as the
    custom loop times its steps after its warm-up (a fit's own start, the broadcast of rank
    0's state and the iterator, is not a step)."""

    def __init__(self):
        super().__init__()
        self.ends: list[float] = []

    def on_epoch_begin(self, epoch, logs=None):
        self.ends = []

    def on_train_batch_end(self, batch, logs=None):
        self.ends.append(time.perf_counter())

    def images_per_sec(self, batch: int) -> float:
        return batch * (len(self.ends) - 1) / (self.ends[-1] - self.ends[0])


def rank(args: argparse.Namespace) -> None:
    """On each rank: the custom loop and fit, alternating; rank 0 writes both rates."""
    import tensorflow as tf

    import tfdist
    import tfdist.horovod.tensorflow as hvd
    from tests.horovod.test_custom_loop_examples import BENCHMARK_CHANGES, PORTED, changed

    runner = tfdist.Runner(tfdist.load_config(overrides={
        "strategy": "horovod", "precision": "float32", "seed": 0}))
    # Each rank its own copy of the changed example (no rank waits for another's file).
    script = os.path.join(os.path.dirname(os.path.abspath(args.output)),
                          f"synthetic_{os.getpid()}.py")
    with open(PORTED / "tensorflow2_synthetic_benchmark.py") as stream:
        source = changed(stream.read(), BENCHMARK_CHANGES)
    with open(script, "w") as stream:
        stream.write(source)
    model, dataset = fit_model(runner, args.model, args.batch, args.steps + 1)
    timer = StepTimes()
    model.fit(dataset, epochs=1, verbose=0, callbacks=[*runner.callbacks(), timer])  # warm-up
    step = custom_loop_step(script, args)
    loop, fit = [], []

    def together() -> None:
        """Every rank leaves here at once, so no rank's timing includes waiting for another."""
        hvd.allreduce(tf.constant(0.0), op=hvd.Sum)

    for _ in range(args.rounds):
        together()
        with tf.device("CPU"):  # as the example's timed loop
            seconds = timeit.timeit(lambda: step(first_batch=False), number=args.steps)
        loop.append(args.batch * args.steps / seconds)
        together()
        model.fit(dataset, epochs=1, verbose=0, callbacks=[*runner.callbacks(), timer])
        fit.append(timer.images_per_sec(args.batch))
    if runner.is_chief:
        write_report(args.output, {"custom_loop": loop, "fit": fit})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="alternations (samples)")
    parser.add_argument("--model", default="ResNet50",
                        help="a keras.applications model (MobileNet: quick, to check the code)")
    parser.add_argument("--batch", type=int, default=8, help="images per rank and step")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per round")
    parser.add_argument("--role", choices=("rank",), help=argparse.SUPPRESS)
    parser.add_argument("--output", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "rank":
        return rank(args)

    rates = run_children([*mpirun(2), sys.executable, os.path.abspath(__file__), "--role=rank",
                          f"--model={args.model}", f"--rounds={args.rounds}",
                          f"--batch={args.batch}", f"--steps={args.steps}"],
                         what="custom_loop: the horovod ranks")
    ratios = [fit / loop for fit, loop in zip(rates["fit"], rates["custom_loop"])]
    figures = [
        figure("fit_over_custom_loop", f"horovod, {args.model} (32 x 32), 2 ranks: images/s "
               "per rank, the adapter's model.fit / Horovod's synthetic-benchmark custom loop",
               ratios, target=">= 0.9"),
        figure("custom_loop_images_per_sec", "Horovod's custom loop: images/s per rank",
               rates["custom_loop"], unit="img/s"),
        figure("fit_images_per_sec", "the adapter's model.fit: images/s per rank",
               rates["fit"], unit="img/s"),
    ]
    for f in figures:
        print(f"{f.label}: {f.median:.3f} ({f.low:.3f}-{f.high:.3f})")
    emit("custom_loop", figures, model=args.model, image=IMAGE, per_rank_batch=args.batch,
         steps=args.steps, rounds=args.rounds, loop_median=statistics.median(rates["custom_loop"]),
         fit_median=statistics.median(rates["fit"]))


if __name__ == "__main__":
    main()
