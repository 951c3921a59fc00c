"""Sharded training state: optimizer bytes, peak memory per rank and step time, by zero_stage.

A 25.6 M-parameter MLP (40 Dense(800) layers, the largest 1/40 of the parameters) trains
with Adam under `horovod` on 2, 4 and 8 local ranks (mpirun), at zero_stage 0, 1 and 2, at
zero_stage 3 with `zero.reshard_after_forward: false` ("3held": each layer's gathered
weights live from its forward to its backward), at zero_stage 3 as it runs by default
("3": each layer's weights are gathered again in the backward pass, each gather waiting
for the layer's own input or incoming gradient), the same one layer ahead ("3p1":
`zero.prefetch: 1`) and in buckets ("3b": `zero.bucket_mb: 16`, one collective per layer
each way), each setting in fresh processes. Every rank reports
its optimizer's variable bytes (`model.optimizer.variables`), the bytes of the weights it
stores (at stage 3 its slices), its step times (the median after the warm-up steps), and
its peak memory as TensorFlow's own allocator counts it
(`tfdist.memory`; the ranks run with `TF_CPU_ALLOCATOR_USE_BFC=true`, so a CPU's figures
are exact bytes, as a GPU's):

- over the whole process up to the end of the last step (the model's build included),
- during the steps alone (from the start of `fit` to the end of its last step), and
- during the whole of `fit`, its end included (where a sharded optimizer hands
  `model.save` the whole state).

Peak resident memory (`ru_maxrss`, glibc with a 1 MiB mmap threshold) is reported beside
them, never as the figure: it counts glibc's arenas too, and moves by hundreds of MB
between ranks of one run.

What each stage should save per rank against stage 0, with Adam in float32 and P
parameters on N ranks (DeepSpeed's accounting): stage 1 the optimizer's moments,
8P(1 - 1/N); stage 2 also the gradients, 12P(1 - 1/N); stage 3 also the weights,
16P(1 - 1/N). The figures are bytes saved over that ideal (target 0.8). A stage-3 rank
that gathers again should hold its slices and a few layers' whole weights: at most
16/N + 1.5 bytes per parameter at its peak. The settings of one rank count run back to
back; each step time is divided by stage 0's of the same rank count (on the first rank
count, stages 0 and 3 run `--rounds` times, each round after the first a pair back to
back, and their ratio is the median of the rounds'), and the effect of prefetch and of
buckets is the step time and peak of "3p1" and "3b" over those of "3", on the same ranks.

Then a projection to a 7 B-parameter model on 8 to 64 ranks, beside DeepSpeed's
published formula (mixed-precision Adam: 16 bytes per parameter unsharded, 4 + 12/N at
stage 1, 2 + 14/N at stage 2, 16/N at stage 3). tfdist trains in float32, its optimizer
bytes per parameter (Adam: 8) measured here. At stage 1 it keeps whole float32 weights
and computes whole float32 gradients (Keras's train step computes every gradient before
the optimizer runs): 8 + (optimizer bytes)/N. At stage 2, and at stage 3 holding each
layer's gathered weights to its backward, the whole float32 weights are alive at the
peak beside the slices: 4 + (8 + optimizer bytes)/N. At stage 3 gathering again, a rank
holds its slices, (4 + optimizer bytes)/N, and what its peak holds beyond them, measured
on each rank count and fitted as a/N + b: a in bytes per parameter (the optimizer's
temporaries of the rank's slices), b in the largest layer's float32 bytes (the layers
gathered at once, the activations, the batch). The 7 B model is shaped as Llama 2 7B
(6.74 B parameters, its largest layers the 32,000 x 4,096 embedding and output
projection). DeepSpeed's formula counts the model states alone, not the parameters its
stage 3 gathers at once (`stage3_max_live_parameters`, 10^9 by default) nor activations.

    .venv/bin/python benchmarks/zero.py [--ranks 2 4 8] [--settings 0 1 2 3held 3 3p1 3b] \
        [--steps 8] [--rounds 3] \
        [--precision float32|mixed_bfloat16|mixed_float16]

The last line is JSON: per setting, the bytes, peak memory and step time of every
rank, the figures against the targets, and the projection.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time

import numpy as np
from method import emit, figure
from processes import mpirun, run_children, write_report

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

WIDTH, LAYERS = 800, 40  # 25.6 M parameters, the largest layer 1/40 of them
# The settings: zero_stage, and at stage 3 whether each layer's weights are gathered again
# in the backward pass (zero.reshard_after_forward), how many layers ahead (zero.prefetch)
# and in buckets of how many MiB (zero.bucket_mb; 0: one collective per weight).
SETTINGS = {"0": (0, True, 1, 0), "1": (1, True, 1, 0), "2": (2, True, 1, 0),
            "3held": (3, False, 1, 0), "3": (3, True, 0, 0), "3p1": (3, True, 1, 0),
            "3b": (3, True, 0, 16)}
# What each stage should save per parameter and rank, times (1 - 1/N): Adam's two float32
# moments at stage 1, the float32 gradient too at stage 2, and the weights at stage 3.
IDEAL_BYTES_PER_PARAMETER = {"1": 8, "2": 12, "3held": 16, "3": 16, "3p1": 16, "3b": 16}
DEEPSPEED = {"0": lambda n: 16.0, "1": lambda n: 4 + 12 / n, "2": lambda n: 2 + 14 / n,
             **{name: lambda n: 16 / n for name in ("3held", "3", "3p1", "3b")}}
# Step time over stage 0's: the issues' bounds.
TIME_TARGETS = {"1": "<= 1.25", "2": "<= 1.1", "3held": "<= 1.3", "3": "<= 1.5", "3p1": "",
                "3b": ""}
# Stage 3's variants measured against "3" on the same ranks: what each changes.
VARIANTS = {"3p1": ("prefetch", "zero.prefetch 1 / with 0"),
            "3b": ("bucket", "zero.bucket_mb 16 / with 0")}
# Llama 2 7B: its parameters, and its largest layers' (the embedding, the output projection).
PROJECTED_PARAMETERS, PROJECTED_LARGEST_LAYER = 6.74e9, 32_000 * 4_096
PROJECTED_RANKS = (8, 16, 32, 64)
PEAKS = {"process": "over the process up to the last step", "steps": "during the steps",
         "fit": "during fit, its end included"}


def mb(count: int) -> int:
    return round(count / 2**20)


def run_rank(args: argparse.Namespace) -> None:
    """One rank of one setting: trains, then writes what it measured."""
    import keras
    import numpy as np
    import tensorflow as tf

    import tfdist
    from tfdist.horovod.collectives import import_horovod
    from tfdist.memory import PeakMemory, allocator_bytes
    from tfdist.sharding import state_bytes, stored_variable

    stage, reshard, prefetch, bucket_mb = SETTINGS[args.setting]
    runner = tfdist.Runner(tfdist.load_config(overrides={
        "strategy": "horovod", "zero_stage": stage, "zero.reshard_after_forward": reshard,
        "zero.prefetch": prefetch, "zero.bucket_mb": bucket_mb, "precision": args.precision,
        "seed": 0}))
    hvd = import_horovod()
    rng = np.random.default_rng(0)
    batch = args.batch_per_rank * runner.num_replicas
    features = rng.random((batch * 4, args.width), dtype=np.float32)
    labels = rng.integers(0, 10, len(features)).astype("int32")
    with runner.scope():
        model = keras.Sequential([keras.Input((args.width,)),
                                  *[keras.layers.Dense(args.width, activation="relu")
                                    for _ in range(args.layers - 1)],
                                  keras.layers.Dense(10, activation="softmax")])
        model.compile(runner.optimizer(keras.optimizers.Adam(1e-4)),
                      "sparse_categorical_crossentropy")

    class Measure(keras.callbacks.Callback):
        """Step times, and the peaks at the end of the last step (before fit's own end,
        where a sharded optimizer hands `model.save` the whole state)."""

        def __init__(self):
            super().__init__()
            self.seconds, self.steps_peak, self.maxrss_mb, self._started = [], 0, 0.0, 0.0

        def on_train_batch_begin(self, batch, logs=None):
            self._started = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            self.seconds.append(time.perf_counter() - self._started)
            # PeakMemory (before this callback) started the allocator's peak at fit's start.
            self.steps_peak = allocator_bytes("CPU:0").peak
            self.maxrss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    peak, measure = PeakMemory(), Measure()
    data = runner.dataset(tf.data.Dataset.from_tensor_slices((features, labels)).repeat(), batch)
    model.fit(data, epochs=1, steps_per_epoch=args.warmup + args.steps, verbose=0,
              callbacks=[*runner.callbacks(), peak, measure])
    allocator = peak.bytes["CPU:0"]
    stored = [stored_variable(weight) for weight in model.weights]
    report = {"rank": hvd.rank(), "state_bytes": state_bytes(model.optimizer),
              "weight_bytes": sum(int(np.prod(v.shape)) * v.dtype.size for v in stored),
              # The process's peak up to the last step: before fit, or during its steps.
              "process_peak_bytes": max(allocator.before_fit, measure.steps_peak),
              "steps_peak_bytes": measure.steps_peak,
              "fit_peak_bytes": allocator.fit,
              "maxrss_mb": measure.maxrss_mb,
              "step_seconds": statistics.median(measure.seconds[args.warmup:]),
              "parameters": model.count_params(),
              "largest_layer_parameters": max(layer.count_params() for layer in model.layers),
              "largest_variable_bytes": max(int(np.prod(v.shape)) * 4
                                            for v in model.trainable_variables)}
    # Every rank's figures to rank 0, which reports them all.
    gathered = hvd.allgather_object(report)
    if hvd.rank() == 0:
        write_report(args.output, sorted(gathered, key=lambda r: r["rank"]))


def measure_settings(args: argparse.Namespace) -> dict[str, list[dict]]:
    """Runs every setting on every rank count in fresh processes; returns each rank's
    report, keyed "{ranks}x{setting}"."""
    settings: dict[str, list[dict]] = {}
    # The children inherit both: the allocator's exact figures on a CPU, and an RSS that
    # follows the bytes alive (a freed tensor's pages go back to the system).
    os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(2**20)

    def run(ranks: int, name: str) -> list[dict]:
        row = run_children(
            [*mpirun(ranks), sys.executable, os.path.abspath(__file__), f"--setting={name}",
             f"--steps={args.steps}", f"--warmup={args.warmup}",
             f"--batch_per_rank={args.batch_per_rank}", f"--width={args.width}",
             f"--layers={args.layers}", f"--precision={args.precision}"],
            what=f"zero_stage {name} on {ranks} ranks")
        print(f"{ranks} ranks, stage {name}: state MB per rank "
              f"{[round(r['state_bytes'] / 2**20, 1) for r in row]}, allocator peak MB "
              f"(process, steps, fit) "
              f"{[tuple(mb(r[f'{key}_peak_bytes']) for key in PEAKS) for r in row]}, "
              f"peak RSS MB {[round(r['maxrss_mb']) for r in row]}, step s "
              f"{[round(r['step_seconds'], 3) for r in row]}", flush=True)
        for report in row:
            report["step_seconds_rounds"] = [report["step_seconds"]]
        return row

    for ranks in args.ranks:
        for name in args.settings:
            settings[f"{ranks}x{name}"] = run(ranks, name)
        if ranks != args.ranks[0] or "3" not in args.settings:
            continue
        # The bound's pair again, back to back: on shared cores one run's step time moves
        # with whatever else ran then, and a round's ratio cancels what both runs met.
        for _ in range(args.rounds - 1):
            for name in ("0", "3"):
                for report, again in zip(settings[f"{ranks}x{name}"], run(ranks, name)):
                    report["step_seconds_rounds"].append(again["step_seconds"])
    return settings


def step_time_ratios(row: list[dict], baseline: list[dict]) -> list[float]:
    """Each rank's step time over the baseline's: the median over the rounds both ran."""
    return [statistics.median([mine / theirs for mine, theirs in
                               zip(report["step_seconds_rounds"], base["step_seconds_rounds"])])
            for report, base in zip(row, baseline)]


def stage_figures(settings: dict[str, list[dict]], ranks: int, name: str,
                  parameters: int) -> list:
    """The figures of setting `name` on `ranks` ranks, against stage 0's of the same run."""
    full, row = settings[f"{ranks}x0"], settings[f"{ranks}x{name}"]
    stage = SETTINGS[name][0]
    full_state = max(r["state_bytes"] for r in full)
    largest_state = 2 * full[0]["largest_variable_bytes"]  # Adam: 2 slots per variable
    bound = full_state / ranks * (1.01 if stage >= 2 else 1) + (
        largest_state if stage == 1 else 0)
    figures = [figure(
        f"state_{ranks}r_s{name}", f"{ranks} ranks, stage {name}: optimizer bytes per rank / "
        f"(unsharded / {ranks}{' + largest variable' if stage == 1 else ''})",
        [r["state_bytes"] / bound for r in row], target="<= 1.0")]
    # Bytes saved per rank against stage 0, over what the stage should save.
    ideal = IDEAL_BYTES_PER_PARAMETER[name] * parameters * (1 - 1 / ranks)
    for key in ("process", "steps"):
        figures.append(figure(
            f"saved_{key}_{ranks}r_s{name}", f"{ranks} ranks, stage {name}: allocator peak "
            f"{PEAKS[key]}, bytes saved per rank / {IDEAL_BYTES_PER_PARAMETER[name]}P(1 - 1/N)",
            [(f[f"{key}_peak_bytes"] - r[f"{key}_peak_bytes"]) / ideal
             for f, r in zip(full, row)], target=">= 0.8"))
    if stage == 3:
        # A rank's whole peak per parameter; gathering again should bring it near 16/N.
        limit = 16 / ranks + 1.5
        for key in PEAKS:
            figures.append(figure(
                f"bytes_per_parameter_{key}_{ranks}r_s{name}", f"{ranks} ranks, stage "
                f"{name}: allocator peak {PEAKS[key]}, bytes per parameter",
                [r[f"{key}_peak_bytes"] / parameters for r in row], unit="bytes",
                target=f"<= {limit:.2f}" if name == "3" and ranks >= 4 else ""))
    figures.append(figure(
        f"rss_saved_{ranks}r_s{name}", f"{ranks} ranks, stage {name}: peak RSS saved per rank "
        f"/ {IDEAL_BYTES_PER_PARAMETER[name]}P(1 - 1/N) (beside: RSS counts glibc's arenas too)",
        [(f["maxrss_mb"] - r["maxrss_mb"]) * 2**20 / ideal for f, r in zip(full, row)]))
    figures.append(figure(
        f"time_{ranks}r_s{name}", f"{ranks} ranks, stage {name}: step time / stage 0's",
        step_time_ratios(row, full), target=TIME_TARGETS[name]))
    return figures


def variant_figures(settings: dict[str, list[dict]], ranks: int, name: str) -> list:
    """The effect of stage 3's variant `name` (`VARIANTS`: one layer ahead, buckets) on
    `ranks` ranks: its step time and peak over those of "3" on the same ranks, rank by rank."""
    key, what = VARIANTS[name]
    variant, plain = settings[f"{ranks}x{name}"], settings[f"{ranks}x3"]
    return [figure(f"{key}_time_{ranks}r", f"{ranks} ranks, stage 3: step time with {what}",
                   [a["step_seconds"] / b["step_seconds"] for a, b in zip(variant, plain)]),
            figure(f"{key}_peak_{ranks}r", f"{ranks} ranks, stage 3: allocator peak "
                   f"{PEAKS['steps']} with {what}",
                   [a["steps_peak_bytes"] / b["steps_peak_bytes"]
                    for a, b in zip(variant, plain)])]


def transient(settings: dict[str, list[dict]], ranks: list[int]) -> dict | None:
    """What a stage-3 rank that gathers again holds beyond its slices and their optimizer
    state at its peak (the worst rank and peak of each rank count), fitted as a/N + b: a
    part that shrinks with the ranks (the optimizer's temporaries of its slices), in bytes
    per parameter times N, and a part that does not (the layers gathered at once, the
    activations), in the largest layer's float32 bytes. None: stage 3 not run."""
    measured = {n: max(r[f"{key}_peak_bytes"] - r["weight_bytes"] - r["state_bytes"]
                       for r in settings[f"{n}x3"] for key in PEAKS)
                for n in ranks if f"{n}x3" in settings}
    if not measured:
        return None
    first = settings[f"{min(measured)}x3"][0]
    parameters, largest = first["parameters"], first["largest_layer_parameters"]
    if len(measured) > 1:
        x = np.array([1 / n for n in measured])
        slope, intercept = np.polyfit(x, np.array(list(measured.values()), float), 1)
        slope, intercept = max(float(slope), 0.0), max(float(intercept), 0.0)
    else:
        slope, intercept = 0.0, float(next(iter(measured.values())))
    return {"bytes": {str(n): b for n, b in measured.items()},
            "per_parameter_times_ranks": slope / parameters,
            "largest_layers": intercept / (4 * largest)}


def projection(settings: dict[str, list[dict]], args: argparse.Namespace,
               parameters: int) -> tuple[dict, dict | None, list]:
    """Bytes per rank for a 7 B-parameter model by setting and rank count, beside
    DeepSpeed's formula; the measured transient of stage 3 gathering again (`transient`);
    and the projection's figures."""
    first = settings[f"{args.ranks[0]}x{args.settings[0]}"][0]
    # Optimizer bytes per parameter, unsharded, as measured (Adam: 8, with the step and rate).
    optimizer_per_parameter = first["state_bytes"] * args.ranks[0] / parameters \
        if SETTINGS[args.settings[0]][0] else first["state_bytes"] / parameters
    held = transient(settings, args.ranks)

    def tfdist_bytes_per_parameter(name: str, n: int) -> float:
        stage = SETTINGS[name][0]
        if name == "3":
            return (4 + optimizer_per_parameter + held["per_parameter_times_ranks"]) / n \
                + held["largest_layers"] * 4 * PROJECTED_LARGEST_LAYER / PROJECTED_PARAMETERS
        if stage >= 2:
            return 4 + (8 + optimizer_per_parameter) / n
        return 8 + optimizer_per_parameter / (n if stage else 1)

    table = {name: {n: {"deepspeed_gb": DEEPSPEED[name](n) * PROJECTED_PARAMETERS / 1e9,
                        "tfdist_gb": tfdist_bytes_per_parameter(name, n)
                        * PROJECTED_PARAMETERS / 1e9}
                    for n in PROJECTED_RANKS}
             for name in SETTINGS if name not in VARIANTS and (name != "3" or held is not None)}
    figures = [figure(f"projection_7b_{n}r_s3", f"7 B parameters on {n} ranks, stage 3 "
                      f"gathering again: tfdist's bytes per rank / DeepSpeed's stage-3 formula",
                      [table["3"][n]["tfdist_gb"] / table["3"][n]["deepspeed_gb"]],
                      target="<= 1.2" if n == PROJECTED_RANKS[0] else "")
               for n in PROJECTED_RANKS if "3" in table]
    return table, held, figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS),
                        help="the zero_stage settings to run; 0 (the baseline) is always run")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per setting")
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the timing")
    parser.add_argument("--rounds", type=int, default=3,
                        help="how many times stages 0 and 3 run on the first rank count, "
                             "for the median of their step-time ratio")
    parser.add_argument("--batch_per_rank", type=int, default=8)
    parser.add_argument("--width", type=int, default=WIDTH,
                        help="the MLP's width (64: a quick run, to check the code)")
    parser.add_argument("--layers", type=int, default=LAYERS, help="the MLP's Dense layers")
    parser.add_argument("--precision", default="float32",
                        help="every setting's policy: under mixed_bfloat16 or mixed_float16 "
                             "stage 3 gathers in the compute dtype")
    parser.add_argument("--setting", choices=list(SETTINGS), help=argparse.SUPPRESS)
    parser.add_argument("--output", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.setting is not None:
        run_rank(args)
        return
    args.settings = ["0", *[name for name in args.settings if name != "0"]]
    settings = measure_settings(args)
    parameters = settings[f"{args.ranks[0]}x0"][0]["parameters"]
    figures = [f for ranks in args.ranks for name in args.settings[1:]
               for f in stage_figures(settings, ranks, name, parameters)]
    figures += [f for name in VARIANTS if {"3", name} <= set(args.settings)
                for ranks in args.ranks for f in variant_figures(settings, ranks, name)]
    table, held, projected = projection(settings, args, parameters)
    figures += projected
    for name, row in table.items():
        print(f"7B, stage {name}: " + ", ".join(
            f"{n} ranks: DeepSpeed {v['deepspeed_gb']:.1f} GB, tfdist {v['tfdist_gb']:.1f} GB"
            for n, v in row.items()))
    emit("zero", figures, parameters=parameters, settings=settings,
         stage_3_transient=held,
         projection={name: {str(n): v for n, v in row.items()} for name, row in table.items()})


if __name__ == "__main__":
    main()
