"""Each benchmark runs in a reduced form and ends with its JSON line; the report renders them.

Nothing here is timed or compared: the checks are that every figure a benchmark
promises is there, finite, inside its own spread, and that ratios are positive.
"""

import json
import math
import sys

import pytest

from tests.conftest import REPO, last_json_line, run_command

# One pytest-xdist worker runs this module: the report's tests read the very runs the
# smoke tests made (`benchmark_line`), rather than running every benchmark again.
pytestmark = pytest.mark.xdist_group("benchmarks")

needs_horovod = [pytest.mark.requires_mpi, pytest.mark.requires_horovod]
QUICK_SYNC_COST = ["--repeats", "1", "--models", "0.1", "--fit_mb", "0.03125", "--fit_mb", "0.25",
                   "--packed_mb", "0.5"]
QUICK_PRECISION = ["--rounds", "2", "--steps", "2", "--batch", "64", "--matmul_size", "512"]


# A hang bound, not a timing: custom_loop.py's smoke run took over 240 s once, beside the
# suite and two other loads on 2 cores.
def run_benchmark(script, args, cwd, timeout=480):
    # The benchmark's own children get the same bound, less the benchmark's start.
    result = run_command([sys.executable, str(REPO / "benchmarks" / script), *args], cwd=cwd,
                         timeout=timeout,
                         env={"BENCHMARK_CHILD_TIMEOUT_SECONDS": str(timeout - 60)})
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    return last_json_line(result.stdout)


@pytest.fixture(scope="module")
def benchmark_line(tmp_path_factory):
    """Runs a benchmark once per (script, args) in this module and returns its JSON line,
    so the report and the projection read the same runs the smoke tests checked."""
    lines = {}

    def run(script, args):
        key = (script, tuple(args))
        if key not in lines:
            lines[key] = run_benchmark(script, args, tmp_path_factory.mktemp("benchmark"))
        return lines[key]

    return run


def check_figures(figures, keys):
    assert keys <= set(figures), keys - set(figures)
    assert all(value > 0 for key, value in figures.items()
               if key in keys and isinstance(value, (int, float)))
    for figure in figures["figures"]:
        numbers = (figure["low"], figure["median"], figure["high"])
        assert all(math.isfinite(value) for value in numbers), figure
        assert figure["low"] <= figure["median"] <= figure["high"], figure
        assert figure["samples"] >= 1
        # A ratio is positive; an error, or bytes saved against a baseline (a stage may
        # cost memory, and RSS moves with glibc's arenas), may not be.
        if (figure["unit"] == "x" and "error" not in figure["name"]
                and "saved" not in figure["name"]):
            assert figure["median"] > 0, figure
        if figure["target"]:
            assert isinstance(figure["met"], bool)


@pytest.mark.parametrize("script, args, keys", [
    ("overhead.py", ["--rounds", "3", "--steps", "2"],
     {"ratio_one_device", "ratio_mirrored", "cpu_ratio_one_device", "cpu_ratio_mirrored"}),
    ("precision.py", QUICK_PRECISION, {"speedup_bf16", "matmul_speedup_bf16"}),
    ("scaling.py", ["--repeats", "1", "--epochs", "2", "--steps", "2"], {"efficiency"}),
    pytest.param("allreduce.py", ["--repeats", "2"],
                 {"ring_64mb_gbps", "memcpy_64mb_gbps", "horovod_64mb_gbps", "gloo_64mb_gbps",
                  "horovod_ratio_resnet50", "horovod_min_ratio"}, marks=needs_horovod),
    pytest.param("sync_cost.py", QUICK_SYNC_COST,
                 {f"{strategy}_0.1mb_{figure}" for strategy in ("mirrored", "multi_worker",
                                                                "horovod")
                  for figure in ("ratio", "model_error")} | {"model_worst_error"},
                 marks=needs_horovod),
    pytest.param("overlap.py", ["--epochs", "2", "--steps", "1", "--model", "small"],
                 {"horovod_buckets_over_grouped", "multi_worker_packed_over_one_pack"},
                 marks=needs_horovod),
    pytest.param("custom_loop.py",
                 ["--model", "MobileNet", "--batch", "2", "--steps", "1", "--rounds", "1"],
                 {"fit_over_custom_loop", "custom_loop_images_per_sec", "fit_images_per_sec",
                  "loop_median", "fit_median"}, marks=needs_horovod),
    pytest.param("accumulation.py",
                 ["--micro_batch", "8", "--epochs", "2", "--updates_per_epoch", "1",
                  "--image", "16", "--mlp_units", "256"],
                 {"memory_ratio_k8_vs_b", "time_ratio_k8_vs_8b", "speedup_k8_multi_worker",
                  "speedup_k8_horovod"}, marks=needs_horovod),
    ("parameter_server.py", ["--steps", "10", "--repeats", "1", "--spe", "1", "--spe", "10",
                             "--workers", "1"],
     {"w1_spe1_ratio", "w1_spe10_ratio", "w1_spe10_raw", "w1_spe10_tfdist", "min_ratio"}),
    pytest.param("checkpoint.py", ["--rounds", "3", "--steps", "2"],
                 {"ratio_one_device", "ratio_mirrored", "save_ms", "horovod_check_us"},
                 marks=needs_horovod),
    pytest.param("zero.py", ["--ranks", "2", "--steps", "1", "--warmup", "1", "--width", "64",
                             "--layers", "4", "--settings", "2", "3held", "3", "3p1", "3b",
                             "--rounds", "2"],
                 {"state_2r_s2", "state_2r_s3", "time_2r_s2", "time_2r_s3held", "time_2r_s3",
                  "saved_steps_2r_s3", "bytes_per_parameter_steps_2r_s3",
                  "projection_7b_8r_s3", "prefetch_time_2r", "prefetch_peak_2r",
                  "bucket_time_2r", "bucket_peak_2r"},
                 marks=needs_horovod),
    ("pipeline.py", ["--units", "64", "--batch", "32", "--repeats", "2"],
     {"speedup_m4_of_ideal", "tensor_parallel_time_ratio", "stage_share_CPU:0"}),
    ("gpu.py", ["--cpu", "--model", "small", "--only", "1", "--image", "32", "--batch", "4",
                "--iters", "2", "--batches_per_iter", "1"], {"images_per_sec_one_device_float32"}),
])
@pytest.mark.multiprocess
@pytest.mark.benchmark
def test_benchmark_prints_its_figures(script, args, keys, benchmark_line):
    check_figures(benchmark_line(script, args), keys)


@pytest.mark.requires_mpi
@pytest.mark.requires_horovod
@pytest.mark.multiprocess
@pytest.mark.benchmark
def test_projection_from_a_measured_sync_cost(benchmark_line, tmp_path):
    (tmp_path / "sync_cost.json").write_text(json.dumps(benchmark_line("sync_cost.py",
                                                                       QUICK_SYNC_COST)))
    figures = run_benchmark("projection.py", ["--sync_cost", str(tmp_path / "sync_cost.json"),
                                              "--batch", "1", "--steps", "1"], tmp_path)
    check_figures(figures, {"resnet50_128_workers_25gbit", "resnet50_128_workers_25gbit_k4"})
    for row in figures["efficiency"].values():  # more workers never scale better
        assert len(row) == 4 and all(0 < b <= a <= 1 for a, b in zip(row, row[1:]))
    assert figures["resnet50_128_workers_25gbit_k4"] > figures["resnet50_128_workers_25gbit"]


@pytest.mark.benchmark
def test_projection_without_a_sync_cost_says_what_to_run(tmp_path):
    result = run_command([sys.executable, str(REPO / "benchmarks" / "projection.py"),
                          "--sync_cost", str(tmp_path / "absent.json")], cwd=tmp_path)
    assert result.returncode == 1
    assert "report.py --only sync_cost" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.multiprocess
@pytest.mark.benchmark
def test_report_renders_every_figure_and_what_was_not_measured(benchmark_line, tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    for name, args in (("precision", QUICK_PRECISION), ("sync_cost", QUICK_SYNC_COST),
                       ("gpu", [])):
        line = benchmark_line(f"{name}.py", args)
        (results / f"{name}.json").write_text(json.dumps({**line, "run": {
            "seconds": 1.0, "steal": 0.0, "status": 0, "finished": "now"}}))
    result = run_command([sys.executable, str(REPO / "benchmarks" / "report.py"), "--render",
                          "--results_dir", str(results), "--output_dir", str(tmp_path)],
                         cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    page = (tmp_path / "RESULTS.md").read_text()
    precision = json.loads((results / "precision.json").read_text())
    for figure in precision["figures"]:
        assert figure["label"] in page
    assert "Not measured: no GPU" in page
    assert "Not run yet" in page  # the benchmarks this test did not run are named, not dropped
    assert (tmp_path / "plots" / "precision.png").stat().st_size > 1000
    assert (tmp_path / "plots" / "sync_cost.png").stat().st_size > 1000
    for strategy in json.loads((results / "sync_cost.json").read_text())["fit"]:
        assert f"- {strategy}: B " in page and "calibration within" in page  # the fitted model
