"""`make bench`: runs every benchmark, then writes RESULTS.md, its plots and the docs' table.

Each benchmark runs as its own process (its default settings, at most 5 minutes);
its output goes to benchmarks/results/NAME.log and its last line, one JSON object,
to benchmarks/results/NAME.json. A benchmark that fails or runs over is reported as
such: nothing is left out. Then, from those JSON files alone:

- benchmarks/RESULTS.md: the machine (CPU, cores, cache, steal time during each
  benchmark), the library versions, and per benchmark every figure with its median,
  spread, target and whether it is met;
- benchmarks/plots/*.png: all-reduce bandwidth, the sync-cost model against the
  measurements, accumulation, mixed precision, the scaling projection;
- docs/evidence/benchmarks.md: the headline table and one plot, between its `results`
  markers (the docs site serves RESULTS.md and the plots beside it: docs/hooks.py).

    .venv/bin/python benchmarks/report.py              # run all, then write
    .venv/bin/python benchmarks/report.py --only overhead --only sync_cost
    .venv/bin/python benchmarks/report.py --render     # write from the last results
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time

from charts import plot_all

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)

RESULTS_DIR = os.path.join(HERE, "results")
PLOTS_DIR = os.path.join(HERE, "plots")
BENCHMARKS_PAGE = os.path.join(REPO, "docs", "evidence", "benchmarks.md")
TIMEOUT_SECONDS = 330  # each benchmark is meant to finish in under 5 minutes
# But zero.py: 21 settings (stages 0, 1, 2, 3 holding, 3 gathering again, one layer ahead
# and in buckets, on 2, 4 and 8 ranks), each in fresh processes that start TensorFlow and
# Horovod and build a 25.6 M parameter model: about 13 minutes here.
TIMEOUTS = {"zero": 1200}

# In the order they run and appear. `projection` reads sync_cost's results.
BENCHMARKS = ("overhead", "precision", "allreduce", "sync_cost", "overlap", "custom_loop",
              "accumulation", "parameter_server", "checkpoint", "scaling", "projection", "zero",
              "pipeline", "gpu")

# The docs' table: the figures an engineer choosing a stack looks at first.
HEADLINES = {
    "overhead": ("ratio_one_device", "ratio_mirrored"),
    "precision": ("speedup_bf16",),
    "allreduce": ("horovod_ratio_resnet50", "horovod_64mb_gbps", "ring_64mb_gbps"),
    "sync_cost": ("horovod_100mb_ratio", "multi_worker_100mb_ratio", "mirrored_100mb_ratio",
                  "model_worst_error"),
    "overlap": ("horovod_buckets_over_grouped", "multi_worker_packed_over_one_pack"),
    "custom_loop": ("fit_over_custom_loop",),
    "accumulation": ("memory_ratio_k8_vs_b", "speedup_k8_horovod", "speedup_k8_multi_worker"),
    "parameter_server": ("w2_spe100_ratio",),
    "checkpoint": ("ratio_one_device",),
    "projection": ("resnet50_128_workers_25gbit", "resnet50_128_workers_25gbit_k4"),
    "zero": ("state_4r_s2", "bytes_per_parameter_steps_8r_s3", "time_2r_s3",
             "prefetch_time_2r", "bucket_time_2r", "projection_7b_8r_s3"),
    "pipeline": ("speedup_m4_of_ideal", "tensor_parallel_time_ratio"),
}


def run_benchmark(name: str, results_dir: str = RESULTS_DIR) -> dict:
    """Runs benchmarks/NAME.py; returns its JSON line with how the run went."""
    from tfdist.cluster import cpu_steal_fraction

    os.makedirs(results_dir, exist_ok=True)
    _, counters = cpu_steal_fraction()
    started = time.perf_counter()
    log_path = os.path.join(results_dir, f"{name}.log")
    with open(log_path, "w") as log:
        try:
            arguments = (["--sync_cost", os.path.join(results_dir, "sync_cost.json")]
                         if name == "projection" else [])
            process = subprocess.run([sys.executable, os.path.join(HERE, f"{name}.py"),
                                      *arguments],
                                     stdout=subprocess.PIPE, stderr=log, text=True,
                                     stdin=subprocess.DEVNULL,
                                     timeout=TIMEOUTS.get(name, TIMEOUT_SECONDS),
                                     env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
            status, stdout = process.returncode, process.stdout
        except subprocess.TimeoutExpired as expired:
            status = "timeout"
            stdout = expired.stdout.decode() if isinstance(expired.stdout, bytes) else (
                expired.stdout or "")
        log.write(stdout)
    steal, _ = cpu_steal_fraction(since=counters)
    run = {"seconds": round(time.perf_counter() - started, 1), "steal": round(steal, 4),
           "status": status, "finished": datetime.datetime.now().isoformat(timespec="seconds"),
           "commit": commit()}
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if status == 0 and lines:
        result = {**json.loads(lines[-1]), "run": run}
    else:
        tail = (stdout.splitlines() or [""])[-1][:300]
        result = {"benchmark": name, "figures": [], "run": {**run, "error": tail,
                                                            "log": os.path.relpath(log_path, REPO)}}
    with open(os.path.join(results_dir, f"{name}.json"), "w") as stream:
        json.dump(result, stream, indent=1)
    print(f"report: {name}: {'done' if status == 0 else f'FAILED ({status})'} in "
          f"{run['seconds']:.0f} s, steal {steal:.1%}", flush=True)
    return result


def load_results(results_dir: str = RESULTS_DIR) -> dict[str, dict]:
    results = {}
    for name in BENCHMARKS:
        path = os.path.join(results_dir, f"{name}.json")
        if os.path.exists(path):
            with open(path) as stream:
                results[name] = json.load(stream)
    return results


def machine() -> dict:
    """What ran the benchmarks: CPU, cores, cache, memory, GPUs, library versions."""
    from tfdist.cluster import detect_cluster

    info = detect_cluster(probe_gpus=False)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    versions = {"Python": platform.python_version()}
    for label, distribution in (("TensorFlow", ("tensorflow-cpu", "tensorflow")),
                                ("Keras", ("keras",)), ("Horovod", ("horovod",)),
                                ("NumPy", ("numpy",)), ("matplotlib", ("matplotlib",))):
        for candidate in distribution:
            try:
                versions[label] = importlib.metadata.version(candidate)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
        else:
            versions[label] = "not installed"
    mpirun = shutil.which("mpirun")
    if mpirun:
        first = subprocess.run([mpirun, "--version"], capture_output=True, text=True).stdout
        versions["Open MPI"] = (re.findall(r"\d+\.\d+\.\d+", first) or ["?"])[0]
    return {"cpu": info.cpu_model or platform.processor() or "unknown",
            "cores": info.cpu_cores, "cache_mib": info.cpu_cache_bytes / 2**20,
            "bf16": info.cpu_bf16, "memory_gib": memory, "versions": versions,
            "kernel": platform.release()}


def commit() -> str:
    """The commit the benchmarks run from, "+changes" when the code differs from it.

    What `make bench` itself writes (results, plots, RESULTS.md, the docs' table) is
    not a change to the code measured.
    """
    head = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True).stdout.strip()
    if not head:
        return "unknown"
    changed = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no",
                              "--", ".", ":!benchmarks/results", ":!benchmarks/plots",
                              ":!benchmarks/RESULTS.md", ":!docs/evidence/benchmarks.md"],
                             capture_output=True, text=True).stdout.strip()
    return head + ("+changes" if changed else "")


def number(value: float, unit: str) -> str:
    if unit == "x":
        return f"{value:.3f}"
    return f"{value:.3g} {unit}" if abs(value) < 1000 else f"{value:,.0f} {unit}"


def spread(figure: dict) -> str:
    """The lowest and highest sample, in the figure's unit."""
    low, high = figure["low"], figure["high"]
    if figure["unit"] == "x":
        return f"{low:.3f}-{high:.3f}"
    return f"{low:.3g}-{high:.3g} {figure['unit']}"


def cell(text: str) -> str:
    """Text for a Markdown table cell: a bare | would end the cell."""
    return text.replace("|", "\\|")


def verdict(figure: dict) -> str:
    if figure["met"] is None:
        return "(no target)"
    return "met" if figure["met"] else "**not met**"


def figure_rows(result: dict) -> list[str]:
    rows = ["| figure | median | min-max | n | 95% interval | target | met |",
            "|---|---|---|---|---|---|---|"]
    for f in result.get("figures", []):
        interval = (f"{number(f['interval'][0], f['unit'])}-{number(f['interval'][1], f['unit'])}"
                    if f.get("interval") else "")
        rows.append(f"| {cell(f['label'])} | {number(f['median'], f['unit'])} | "
                    f"{spread(f)} | "
                    f"{f['samples']} | {interval} | {f['target'] or '-'} | {verdict(f)} |")
    return rows


def summary(name: str) -> str:
    """The first paragraph of a benchmark's docstring: what ran against what."""
    path = os.path.join(HERE, f"{name}.py")
    with open(path) as stream:
        text = stream.read()
    docstring = text.split('"""')[1] if '"""' in text else ""
    return " ".join(docstring.strip().split("\n\n")[0].split())


def render_results(results: dict[str, dict], facts: dict, plots: dict[str, str]) -> str:
    steal = [r["run"]["steal"] for r in results.values() if r.get("run")]
    lines = [
        "# Benchmark results",
        "",
        "Written by `make bench` (`benchmarks/report.py`); every number below comes from "
        "`benchmarks/results/*.json`, and each benchmark's section names the commit it ran "
        "at. Absolute times vary on a shared machine; the ratios are what to read.",
        "",
        "## Machine",
        "",
        "| | |",
        "|---|---|",
        f"| CPU | {facts['cpu']}, {facts['cores']} cores, {facts['cache_mib']:.0f} MiB "
        f"last-level cache, bfloat16 instructions: {'yes' if facts['bf16'] else 'no'} |",
        f"| Memory | {facts['memory_gib']:.0f} GiB |",
        f"| Kernel | {facts['kernel']} |",
        f"| Steal time during the run | {max(steal, default=0):.1%} at most "
        "(per benchmark below) |",
        "| Versions | " + ", ".join(f"{k} {v}" for k, v in facts["versions"].items()) + " |",
        "",
        "## Every target",
        "",
        "| benchmark | figure | median (min-max) | target | met |",
        "|---|---|---|---|---|",
    ]
    for name, result in results.items():
        for f in result.get("figures", []):
            if f["target"]:
                lines.append(f"| {name} | {cell(f['label'])} | {number(f['median'], f['unit'])} "
                             f"({spread(f)}) | "
                             f"{f['target']} | {verdict(f)} |")
    for name in BENCHMARKS:
        result = results.get(name)
        lines += ["", f"## {name}", "", summary(name), ""]
        if result is None:
            lines.append("Not run yet: `.venv/bin/python benchmarks/report.py --only "
                         f"{name}`.")
            continue
        run = result.get("run", {})
        lines.append(f"`.venv/bin/python benchmarks/{name}.py`: {run.get('seconds', 0):.0f} s, "
                     f"steal time {run.get('steal', 0):.1%}, finished {run.get('finished', '?')} "
                     f"at commit {run.get('commit', 'unknown')}.")
        lines.append("")
        if run.get("status", 0) != 0:
            lines.append(f"**Failed** ({run.get('status')}): {run.get('error', '')} "
                         f"(log: `{run.get('log', '')}`).")
            continue
        if result.get("measured") is False:
            lines.append(f"Not measured: {result.get('reason', '')}.")
            continue
        lines += figure_rows(result)
        lines += extra_tables(name, result)
        if name in plots:
            lines += ["", f"![{name}](plots/{os.path.basename(plots[name])})"]
    return "\n".join(lines) + "\n"


def extra_tables(name: str, result: dict) -> list[str]:
    """Series a benchmark reports beside its figures, as tables."""
    lines = []
    if name == "sync_cost":
        lines += ["", "| strategy, gradients | tensors | tfdist ms | raw ms | ring model ms |",
                  "|---|---|---|---|---|"]
        for key, row in result["table"].items():
            lines.append(f"| {key.rsplit('_', 1)[0]}, {row['megabytes']:.3g} MB | "
                         f"{row['tensors']} | {row['tfdist_ms']:.2f} | {row['raw_ms']:.2f} | "
                         f"{row['model_ms']:.2f} |")
        lines += ["", "Fitted model per strategy (ring_model.py): bandwidth B up to the switch "
                  "and beyond it, the switch, latency a per ring step, the pack's copy rate P, "
                  "t per tensor; and the largest error of the fit on its own calibration runs:",
                  ""]
        for strategy, fit in result["fit"].items():
            worst = max(abs(row["model_ms"] / row["ms"] - 1)
                        for row in result["calibration"][strategy].values())
            switch = f"{fit['switch_mb']:.3g} MB" if fit["switch_mb"] else "none"
            pack = f"{fit['pack_gbps']:.3g} GB/s" if fit["pack_gbps"] else "no copy"
            lines.append(f"- {strategy}: B {fit['bandwidth_small_gbps']:.3g} / "
                         f"{fit['bandwidth_large_gbps']:.3g} GB/s, switch {switch}, "
                         f"a {fit['latency_us']:.0f} us, P {pack}, "
                         f"t {fit['per_tensor_us']:.0f} us; calibration within {worst:.0%} "
                         f"({len(result['calibration'][strategy])} runs)")
    if name == "allreduce":
        series = result["series"]
        sizes = sorted({size for column in series.values() for size in column},
                       key=lambda s: (s == "resnet50", float(s) if s != "resnet50" else 0))
        lines += ["", "| MB | " + " | ".join(series) + " |",
                  "|---|" + "---|" * len(series)]
        for size in sizes:
            lines.append(f"| {size} | " + " | ".join(
                f"{column[size]:.3f}" if size in column else "" for column in series.values())
                + " |")
        lines.append("\n(GB/s: bytes over the median time of one all-reduce.)")
    if name == "projection":
        lines += ["", "| model, link | " + " | ".join(
            f"{n} workers" for n in result["workers"]) + " |",
            "|---|" + "---|" * len(result["workers"])]
        for key, row in result["efficiency"].items():
            lines.append(f"| {key} | " + " | ".join(f"{v:.0%}" for v in row) + " |")
    return lines


def render_headline_table(results: dict[str, dict]) -> str:
    rows = ["| benchmark | figure | measured (min-max) | target | met |", "|---|---|---|---|---|"]
    for name, wanted in HEADLINES.items():
        for f in results.get(name, {}).get("figures", []):
            if f["name"] in wanted:
                rows.append(f"| {name} | {cell(f['label'])} | {number(f['median'], f['unit'])} "
                            f"({spread(f)}) | "
                            f"{f['target'] or '-'} | {verdict(f)} |")
    return "\n".join(rows)


def update_benchmarks_page(results: dict[str, dict], facts: dict, plots: dict[str, str]) -> None:
    """Replaces the benchmarks page's text between its results markers."""
    begin, end = "<!-- results:begin -->", "<!-- results:end -->"
    with open(BENCHMARKS_PAGE) as stream:
        text = stream.read()
    if begin not in text or end not in text:
        raise SystemExit(f"report: {BENCHMARKS_PAGE} has no {begin} ... {end} block to fill")
    plot = plots.get("projection") or plots.get("allreduce")
    block = "\n".join([
        begin,
        f"Measured by `make bench` on {facts['cpu']} ({facts['cores']} cores), TensorFlow "
        f"{facts['versions'].get('TensorFlow')}; every figure, its spread and the machine "
        "are in [RESULTS.md](results.md).",
        "",
        render_headline_table(results),
        "",
        *([f"![{os.path.basename(plot)}](plots/{os.path.basename(plot)})", ""]
          if plot else []),
        end])
    text = text[:text.index(begin)] + block + text[text.index(end) + len(end):]
    with open(BENCHMARKS_PAGE, "w") as stream:
        stream.write(text)


def write(results: dict[str, dict], output_dir: str = HERE, readme: bool = True) -> None:
    """RESULTS.md and plots/ in `output_dir`; with `readme`, the docs' table too."""
    facts = machine()
    plots = plot_all(results, os.path.join(output_dir, "plots"))
    results_md = os.path.join(output_dir, "RESULTS.md")
    with open(results_md, "w") as stream:
        stream.write(render_results(results, facts, plots))
    if readme:
        update_benchmarks_page(results, facts, plots)
    print(f"report: wrote {results_md}, {len(plots)} plots"
          + (" and the docs' table" if readme else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", choices=BENCHMARKS,
                        help="run these benchmarks only (the others' last results stay)")
    parser.add_argument("--render", action="store_true",
                        help="run nothing: write from the last results")
    parser.add_argument("--results_dir", default=RESULTS_DIR,
                        help="where each benchmark's JSON and log go (and are read from)")
    parser.add_argument("--output_dir", default=HERE,
                        help="where RESULTS.md and plots/ go; the docs' table is updated only "
                             "with the default")
    args = parser.parse_args()
    if not args.render:
        for name in args.only or BENCHMARKS:
            run_benchmark(name, args.results_dir)
    results = load_results(args.results_dir)
    write(results, args.output_dir, readme=os.path.abspath(args.output_dir) == HERE)
    failed = [name for name, r in results.items() if r.get("run", {}).get("status", 0) != 0]
    if failed:
        raise SystemExit(f"report: failed: {', '.join(failed)} (see {args.results_dir}/*.log)")


if __name__ == "__main__":
    main()
