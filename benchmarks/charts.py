"""The plots of `make bench`: one PNG per benchmark that has a picture, from its JSON.

    from charts import plot_all

    plots = plot_all(load_results(), "benchmarks/plots")  # benchmark -> PNG path
"""

from __future__ import annotations

import math
import os
import sys

from ring_model import RingModel

# scripts/setup.sh installs matplotlib here rather than into .venv itself: Keras imports
# matplotlib.pyplot whenever it is importable, ~0.9 s of CPU in every TensorFlow process.
# Appended, so that the environment's own packages (NumPy) come first.
PLOTTING_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                            ".venv", "plotting")
if os.path.isdir(PLOTTING_DIR) and PLOTTING_DIR not in sys.path:
    sys.path.append(PLOTTING_DIR)


def plot_all(results: dict[str, dict], plots_dir: str) -> dict[str, str]:
    """Draws what the results hold.

    Args:
        results: Benchmark name -> its JSON line (benchmarks/results/NAME.json).
        plots_dir: Where the PNGs go.

    Returns:
        Benchmark name -> the path of its PNG.
    """
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    os.makedirs(plots_dir, exist_ok=True)
    plots = {}

    def save(name: str, figure) -> None:
        path = os.path.join(plots_dir, f"{name}.png")
        figure.tight_layout()
        # No timestamp in the file, so an unchanged plot is an unchanged file.
        figure.savefig(path, dpi=100, metadata={"Software": None})
        plots[name] = path

    def ok(name):
        result = results.get(name)
        return bool(result and result.get("figures") and result.get("measured") is not False)

    if ok("allreduce"):
        figure, axes = plt.subplots(figsize=(7, 4.2))
        for column, values in results["allreduce"]["series"].items():
            points = sorted((float(k), v) for k, v in values.items() if k != "resnet50")
            axes.plot(*zip(*points), marker="o", label=column)
        axes.set(xscale="log", yscale="log", xlabel="message (MB)", ylabel="GB/s",
                 title="All-reduce bandwidth, 2 local processes")
        axes.legend()
        save("allreduce", figure)
    if ok("sync_cost"):
        save("sync_cost", sync_cost_figure(plt, results["sync_cost"]))
    if ok("accumulation"):
        result = results["accumulation"]
        figure, (memory, speed) = plt.subplots(1, 2, figsize=(8, 3.6))
        b, k = result["micro_batch"], result["k"]
        labels = {"b_k1": f"batch {b}", "b_k8": f"{b} x k={k}", "8b_k1": f"batch {b * k}"}
        memory.bar(list(labels.values()), [result["maxrss_mb"][key] for key in labels])
        memory.set(ylabel="peak resident MB", title="Memory")
        speedups = {f["name"].removeprefix("speedup_k8_"): f["median"]
                    for f in result["figures"] if f["name"].startswith("speedup_k8_")}
        speed.bar(list(speedups), list(speedups.values()))
        speed.axhline(1.0, color="gray", linewidth=0.8)
        speed.set(ylabel=f"samples/s, k={k} / k=1", title="Less communication")
        save("accumulation", figure)
    if ok("precision"):
        figure, axes = plt.subplots(figsize=(5, 3.6))
        bars = {"end to end": results["precision"]["speedup_bf16"],
                "bare matmul": results["precision"]["matmul_speedup_bf16"]}
        axes.bar(list(bars), list(bars.values()))
        axes.axhline(1.0, color="gray", linewidth=0.8)
        axes.set(ylabel="mixed_bfloat16 / float32", title="Mixed-precision speed-up (CPU)")
        save("precision", figure)
    if ok("projection"):
        result = results["projection"]
        figure, axes = plt.subplots(figsize=(8, 4.8))
        for key, row in result["efficiency"].items():
            if not key.startswith("resnet50") or result["headline_device"] not in key:
                continue
            axes.plot(result["workers"], row, marker="o",
                      label=key.replace(f"resnet50, {result['headline_device']}, ", ""),
                      linestyle="--" if "k=" in key else "-")
        low, high = result["horovod_paper_128_gpus"]
        axes.axhspan(low, high, color="gray", alpha=0.3, label="Horovod paper, 128 GPUs")
        axes.set(xscale="log", xlabel="workers", ylabel="weak-scaling efficiency",
                 ylim=(0, 1.05), title=f"ResNet-50, projected (ring model, no overlap)\n"
                 f"compute: {result['headline_device']}")
        axes.set_xticks(result["workers"], [str(n) for n in result["workers"]])
        axes.legend(fontsize=7, loc="lower left")
        save("projection", figure)
    if ok("zero"):
        result = results["zero"]
        settings = result["settings"]
        figure, (state, peak) = plt.subplots(1, 2, figsize=(10, 3.8))
        labels = list(settings)
        millions = result["parameters"] / 1e6
        state.bar(labels, [max(r["state_bytes"] for r in settings[key]) / 2**20
                           for key in labels])
        state.set(ylabel="optimizer MB per rank", xlabel="ranks x zero_stage",
                  title=f"Optimizer state (Adam, {millions:.1f} M parameters)")
        peak.bar(labels, [max(r["steps_peak_bytes"] for r in settings[key])
                          / result["parameters"] for key in labels])
        peak.set(ylabel="allocator peak, bytes per parameter", xlabel="ranks x zero_stage",
                 title="Peak memory per rank during the steps (3held: stage 3 holding)")
        for axes in (state, peak):
            axes.tick_params(axis="x", labelrotation=60, labelsize=7)
        save("zero", figure)
    if ok("pipeline"):
        result = results["pipeline"]
        figure, axes = plt.subplots(figsize=(5, 3.6))
        counts = [1, 2, 4, 8]
        serial = sorted(result["step_seconds"]["m1"])[len(result["step_seconds"]["m1"]) // 2]
        measured = [serial / sorted(values)[len(values) // 2] for values in
                    (result["step_seconds"][f"m{m}"] for m in counts)]
        ideal = [2 * m / (m + 1) for m in counts]  # GPipe, K = 2 stages
        axes.plot(counts, measured, "o-", label="measured")
        axes.plot(counts, ideal, "--", color="gray", label="GPipe's ideal (K = 2)")
        axes.set(xscale="log", xlabel="micro-batches M", ylabel="speed-up over M = 1",
                 title=f"Pipeline of 8 Dense({result['units']}) over 2 devices")
        axes.set_xticks(counts, [str(m) for m in counts])
        axes.set_xticks([], minor=True)
        axes.legend()
        save("pipeline", figure)
    plt.close("all")
    return plots


def sync_cost_figure(plt, result: dict):
    """Per strategy: the calibration sweep and the fitted model's curve (single tensors),
    and the three gradient sets, measured against predicted."""
    strategies = list(result["fit"])
    figure, panels = plt.subplots(1, len(strategies), figsize=(4 * len(strategies), 3.8),
                                  squeeze=False)
    for axes, strategy in zip(panels[0], strategies):
        fit = result["fit"][strategy]
        model = RingModel(
            bandwidth_small=fit["bandwidth_small_gbps"] * 1e9,
            bandwidth_large=fit["bandwidth_large_gbps"] * 1e9,
            switch_bytes=(fit["switch_mb"] or math.inf) * 2**20,
            latency=fit["latency_us"] * 1e-6,
            pack_bandwidth=(fit["pack_gbps"] or math.inf) * 1e9,
            per_tensor=fit["per_tensor_us"] * 1e-6)
        singles = sorted((int(key) * 4 / 2**20, row["ms"])
                         for key, row in result["calibration"][strategy].items()
                         if key.isdigit())
        axes.plot(*zip(*singles), marker=".", linestyle="", color="gray",
                  label="calibration, one tensor")
        sizes = [singles[0][0] * (singles[-1][0] / singles[0][0]) ** (i / 99) for i in range(100)]
        axes.plot(sizes, [model.seconds(mb * 2**20) * 1e3 for mb in sizes], color="gray",
                  linewidth=0.8, label="model, one tensor")
        rows = [row for key, row in result["table"].items() if key.rsplit("_", 1)[0] == strategy]
        axes.plot([r["megabytes"] for r in rows], [r["tfdist_ms"] for r in rows], marker="o",
                  linestyle="", color="C0", label="gradients, measured")
        axes.plot([r["megabytes"] for r in rows], [r["model_ms"] for r in rows], marker="x",
                  linestyle="", color="C3", markersize=9, label="gradients, predicted")
        axes.set(xscale="log", yscale="log", xlabel="MB", title=strategy)
        if axes is panels[0][0]:
            axes.set_ylabel("ms per all-reduce")
            axes.legend(fontsize=7)
    figure.suptitle("Gradient sync, 2 replicas: ring model fitted to the sweep, "
                    "checked on gradient sets it was not fitted on", fontsize=9)
    return figure
