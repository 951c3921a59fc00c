"""What exact resume costs: the checkpoint callback per step, a save, and Horovod's stop vote.

1. Step time of `model.fit` with `runner.callbacks(checkpoint_dir=...)` (saving at epoch
   ends, which are not timed) against `runner.callbacks()`, for `one_device` and `mirrored`
   (2 logical CPU devices): the two alternate epoch by epoch in one process, the first
   round is left out, the figures are medians. What remains per step is the callback's
   bookkeeping and the stop check.
2. One save of the model and its Adam slots (median of 10), in milliseconds.
3. Under `horovod` (2 ranks under mpirun), what preemption handling adds per update: the
   vote that rides with the gradient allreduce (the adapter's reduction of 1 MB with it
   against without it, interleaved, median of 200 each) and the check at each step
   boundary (reading the vote), in microseconds.

    .venv/bin/python benchmarks/checkpoint.py [--rounds 11] [--steps 40]

The last line is JSON: `ratio_one_device` and `ratio_mirrored` (with / without the
callback; target <= 1.01), `save_ms`, `horovod_vote_us` and `horovod_check_us` (0 when
Open MPI is missing).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfdist  # noqa: E402
from method import emit, figure, interleaved  # noqa: E402
from processes import mpirun, run_children, write_report  # noqa: E402
from tfdist.callbacks import Throughput  # noqa: E402
from tfdist.devices import split_cpu  # noqa: E402
from workloads import BATCH, classifier, examples  # noqa: E402


def prepared(strategy_name: str, data: tf.data.Dataset, checkpoint_dir: str | None):
    runner = tfdist.Runner(tfdist.load_config(overrides={
        "strategy": strategy_name, "precision": "float32", "mirrored.cpu_replicas": 2,
        "seed": 0}))
    with runner.scope():
        model = classifier(dropout=0.1)
        model.compile(optimizer=runner.optimizer(keras.optimizers.Adam(1e-3)),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    dataset = runner.dataset(data, BATCH, shuffle_buffer_size=1024)
    return model, dataset, runner.callbacks(checkpoint_dir=checkpoint_dir)


def step_overhead(strategy_name: str, rounds: int, steps: int, folder: str) -> dict:
    data = examples(steps)
    runs = {"with": prepared(strategy_name, data, os.path.join(folder, strategy_name)),
            "without": prepared(strategy_name, data, None)}
    timers = {name: Throughput(BATCH) for name in runs}
    for epoch in range(rounds):
        for name, (model, dataset, callbacks) in runs.items():  # interleaved A/B
            # The timer first: its epoch ends before the checkpoint's epoch-end save.
            model.fit(dataset, initial_epoch=epoch, epochs=epoch + 1, verbose=0,
                      callbacks=[timers[name], *callbacks])
    step = {name: BATCH / timer.examples_per_sec for name, timer in timers.items()}
    ratios = [without / with_ for with_, without in zip(timers["with"].epoch_rates[1:],
                                                        timers["without"].epoch_rates[1:])]
    return {"with_ms": step["with"] * 1e3, "without_ms": step["without"] * 1e3,
            "ratios": ratios}


def save_milliseconds(folder: str, repeats: int = 10) -> list[float]:
    from tfdist.resume.checkpointing import CheckpointStore, TrainingPosition

    model = classifier(dropout=0.1)
    optimizer = keras.optimizers.Adam(1e-3)
    optimizer.build(model.trainable_variables)
    store = CheckpointStore(os.path.join(folder, "saves"), {
        "model": list(model.variables), "optimizer": optimizer,
        "position": TrainingPosition()}, is_writer=True, keep=3)
    numbers = iter(range(repeats + 1))
    seconds = interleaved({"save": lambda: store.save(next(numbers))}, repeats, warmup=1)
    return [s * 1e3 for s in seconds["save"]]


def horovod_vote_microseconds() -> tuple[float, float]:
    """(vote, check) in microseconds under mpirun -np 2; zeros without Open MPI."""
    if shutil.which("mpirun") is None:
        return 0.0, 0.0
    figures = run_children([*mpirun(2), sys.executable, os.path.abspath(__file__), "--vote"],
                           what="the Horovod vote", timeout=180)
    return figures["vote_us"], figures["check_us"]


def vote(output: str) -> None:
    """On each rank: the gradient reduction with and without the vote, and the check."""
    runner = tfdist.Runner(tfdist.load_config(overrides={"strategy": "horovod"}))
    optimizer = runner.optimizer(keras.optimizers.SGD(0.1))  # reduces with Horovod
    gradients = [tf.ones([2**18], tf.float32)]  # 1 MB

    def traced():
        return tf.function(lambda grads: tf.reshape(optimizer.reduce(grads)[0], [-1])[0])

    without = traced()
    float(without(gradients))  # traced without the vote
    agreement = runner._adapter.stop_agreement("benchmark")  # from here on, with it
    with_vote = traced()
    times: dict[str, list[float]] = {"with": [], "without": [], "check": []}
    for repeat in range(220):
        for name, function in (("without", without), ("with", with_vote)):
            started = time.perf_counter()
            float(function(gradients))
            times[name].append(time.perf_counter() - started)
        started = time.perf_counter()
        agreement.should_stop(repeat + 1, False)
        times["check"].append(time.perf_counter() - started)
    median = {name: statistics.median(values[20:]) * 1e6 for name, values in times.items()}
    if runner.is_chief:
        write_report(output, {"vote_us": median["with"] - median["without"],
                              "check_us": median["check"]})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=11,
                        help="epochs per variant; the first is warm-up")
    parser.add_argument("--steps", type=int, default=40, help="steps per epoch")
    parser.add_argument("--vote", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--output", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.vote:
        return vote(args.output)
    split_cpu(2)
    folder = tempfile.mkdtemp(prefix="tfdist-benchmark-")
    try:
        results = {name: step_overhead(name, args.rounds, args.steps, folder)
                   for name in ("one_device", "mirrored")}
        save_ms = save_milliseconds(folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    vote_us, check_us = horovod_vote_microseconds()
    figures = [figure(f"ratio_{name}", f"{name}: step time with the checkpoint callback / "
                      "without (saves not timed)", result["ratios"], target="<= 1.01",
                      interval=True) for name, result in results.items()]
    save = figure("save_ms", "one atomic save, model + Adam slots", save_ms, unit="ms")
    print(f"{'strategy':<12} {'with ms/step':>13} {'without ms/step':>16} {'ratio':>7}")
    for (name, result), ratio in zip(results.items(), figures):
        print(f"{name:<12} {result['with_ms']:>13.2f} {result['without_ms']:>16.2f} "
              f"{ratio.median:>7.3f}")
    parameters = classifier(dropout=0.1).count_params()
    print(f"one save (model + Adam slots, {parameters} parameters): {save.median:.1f} ms")
    print(f"horovod, 2 ranks: the vote adds {vote_us:.0f} us to a 1 MB gradient allreduce; "
          f"the check at a step boundary takes {check_us:.0f} us")
    emit("checkpoint", [*figures, save], rounds=args.rounds, steps_per_epoch=args.steps,
         **{f"step_ms_{name}": {k: round(v, 3) for k, v in result.items() if k != "ratios"}
            for name, result in results.items()},
         horovod_vote_us=round(vote_us, 1), horovod_check_us=round(check_us, 1))


if __name__ == "__main__":
    main()
