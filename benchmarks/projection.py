"""Weak-scaling efficiency projected to 2-128 workers, from measured compute and the ring model.

A synchronous step on N workers costs compute C (unchanged: the per-worker batch
is fixed) plus the gradient all-reduce, which the ring model (ring_model.py) prices as

    T(N) = 2(N-1)/N x S / B + 2(N-1) x a + S / P + (n - 1) x t

for S bytes in n tensors over links of bandwidth B, fused as Horovod fuses them.
Efficiency is C / (C + T(N)) (with accumulation of k micro-batches: k C / (k C + T(N)),
one all-reduce per k), assuming no overlap of compute and communication: a lower bound.

- C: measured by benchmarks/compute.py, here on this machine's CPU, and on GPUs
  as recorded in benchmarks/measured/compute_*.json (each file says where and how).
- S, n: ResNet-50 (25.6 M parameters, 214 tensors) and a 100 M-parameter MLP.
- B: 10, 25 and 100 Gbit/s links.
- t and P: the per-tensor cost and the fusion buffer's copy rate fitted by
  benchmarks/sync_cost.py for `horovod` (results/sync_cost.json). P applies where
  compute ran on this CPU; on a GPU the copy runs in device memory (ResNet-50's
  98 MB at an H100's 3.35 TB/s: 0.03 ms, against 25 ms of compute) and is left out.
- a: 50 us per ring step, a kernel TCP round trip inside one data centre; assumed,
  not measured (local processes have no network).

The sync_cost benchmark validates the model's form on what can be measured here
(2 processes); this benchmark only extrapolates it. For comparison, the Horovod
paper (Sergeev and Del Balso, 2018) measured about 90% at 128 GPUs for ResNet-101
and Inception V3 over 25 Gbit/s RoCE, with fusion and overlap.

    .venv/bin/python benchmarks/projection.py [--sync_cost benchmarks/results/sync_cost.json]

The last line is JSON: efficiency per model, compute device, link and worker count.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys

from method import emit, figure
from processes import run_children
from ring_model import RingModel

HERE = os.path.dirname(os.path.abspath(__file__))
WORKERS = (2, 8, 32, 128)
LINKS_GBIT = (10, 25, 100)
HOP_LATENCY = 50e-6  # s per ring step; assumed (see the docstring)
K = 4


def efficiency(compute: float, sync: float, k: int = 1) -> float:
    """Weak-scaling efficiency with no overlap; one all-reduce per k micro-batches."""
    return k * compute / (k * compute + sync)


def compute_times(args: argparse.Namespace) -> list[dict]:
    """This machine's compute times (measured now), then the recorded GPU ones."""
    measured = [run_children([sys.executable, os.path.join(HERE, "compute.py"),
                              f"--batch={args.batch}", f"--steps={args.steps}"],
                             what="projection: compute.py")]
    for path in sorted(glob.glob(os.path.join(HERE, "measured", "compute_*.json"))):
        with open(path) as stream:
            measured.append({**json.load(stream), "file": os.path.relpath(path, HERE)})
    return measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sync_cost", default=os.path.join(HERE, "results", "sync_cost.json"),
                        help="sync_cost.py's JSON line, for the per-tensor and copy costs")
    parser.add_argument("--batch", type=int, default=8, help="per-worker batch on this CPU")
    parser.add_argument("--steps", type=int, default=3, help="steps per timed epoch")
    args = parser.parse_args()
    try:
        with open(args.sync_cost) as stream:
            fit = json.load(stream)["fit"]["horovod"]
    except (OSError, KeyError, ValueError):
        raise SystemExit(f"projection: no horovod fit in {args.sync_cost}; run "
                         "`.venv/bin/python benchmarks/report.py --only sync_cost` first")
    per_tensor = fit["per_tensor_us"] * 1e-6
    pack_bandwidth = fit["pack_gbps"] * 1e9 if fit.get("pack_gbps") else math.inf
    table, figures = {}, []
    measurements = compute_times(args)
    # The headline: ResNet-50 at 25 Gbit/s (the Horovod paper's links), with the first
    # GPU measurement's compute time where one is recorded, else this CPU's.
    headline = next((m for m in measurements if "file" in m), measurements[0])
    headline_device = ""
    for measured in measurements:
        device = f"{measured['device']} ({measured['backend']}, {measured['precision']}, " \
                 f"batch {measured['batch']})"
        for model, result in measured["models"].items():
            size = result["parameters"] * 4  # float32 gradients
            compute = result["ms"] / 1e3
            # The fusion buffer's copy at this CPU's rate, or in a GPU's memory: negligible.
            copy_rate = pack_bandwidth if measured["device"] == "CPU" else math.inf
            for gbit in LINKS_GBIT:
                link = RingModel(bandwidth_small=gbit * 1e9 / 8, bandwidth_large=gbit * 1e9 / 8,
                                 switch_bytes=math.inf, latency=HOP_LATENCY,
                                 pack_bandwidth=copy_rate, per_tensor=per_tensor)
                for k in (1, K):
                    row = [efficiency(compute, link.seconds(
                        size, result["gradient_tensors"], copied=True, replicas=n), k)
                        for n in WORKERS]
                    key = f"{model}, {device}, {gbit} Gbit/s" + (f", k={k}" if k > 1 else "")
                    table[key] = [round(value, 4) for value in row]
                    if measured is headline:
                        headline_device = device
                    if gbit == 25 and model == "resnet50" and measured is headline:
                        figures.append(figure(
                            "resnet50_128_workers_25gbit" + (f"_k{k}" if k > 1 else ""),
                            f"ResNet-50, 128 workers, 25 Gbit/s, compute on {device}"
                            + (f", k={k}" if k > 1 else "") + ": projected efficiency",
                            [row[-1]]))
    width = max(len(key) for key in table)
    print(f"{'model, compute, link':<{width}} " + " ".join(f"{n:>6}" for n in WORKERS))
    for key, row in table.items():
        print(f"{key:<{width}} " + " ".join(f"{value:>6.0%}" for value in row))
    emit("projection", figures, workers=list(WORKERS), links_gbit=list(LINKS_GBIT),
         hop_latency_us=HOP_LATENCY * 1e6, per_tensor_us=round(per_tensor * 1e6, 1),
         pack_gbps=round(pack_bandwidth / 1e9, 3) if math.isfinite(pack_bandwidth) else None, k=K,
         efficiency=table, headline_device=headline_device,
         horovod_paper_128_gpus=[0.88, 0.90])


if __name__ == "__main__":
    main()
