"""Each benchmark runs and ends with its JSON line. Nothing here is timed or compared."""

import sys

import pytest

from tests.conftest import REPO, last_json_line, run_command


@pytest.mark.parametrize("script, args, keys", [
    ("overhead.py", ["--rounds", "2", "--steps", "2"], {"ratio_one_device", "ratio_mirrored"}),
    ("precision.py", ["--rounds", "2", "--steps", "2"], {"speedup_bf16", "matmul_gflops"}),
    ("scaling.py", ["--repeats", "1", "--epochs", "2", "--steps", "2"], {"efficiency"}),
    pytest.param("allreduce.py", ["--repeats", "2"],
                 {"ring_64mb_gbps", "memcpy_64mb_gbps", "horovod_64mb_gbps", "horovod_min_ratio"},
                 marks=[pytest.mark.requires_mpi, pytest.mark.requires_horovod]),
    pytest.param("accumulation.py",
                 ["--micro_batch", "8", "--epochs", "2", "--updates_per_epoch", "1"],
                 {"memory_ratio_k8_vs_b", "time_ratio_k8_vs_8b", "speedup_k8_multi_worker",
                  "speedup_k8_horovod"}, marks=[pytest.mark.requires_mpi, pytest.mark.requires_horovod]),
    ("parameter_server.py", ["--steps", "10", "--repeats", "1", "--spe", "1", "--spe", "10",
                             "--workers", "1"],
     {"w1_spe1_ratio", "w1_spe10_ratio", "w1_spe10_raw", "w1_spe10_tfdist", "min_ratio"}),
    pytest.param("checkpoint.py", ["--rounds", "2", "--steps", "2"],
                 {"ratio_one_device", "ratio_mirrored", "save_ms", "horovod_check_us"}, marks=[pytest.mark.requires_mpi, pytest.mark.requires_horovod]),
])
@pytest.mark.multiprocess
@pytest.mark.benchmark
def test_benchmark_prints_its_figures(script, args, keys, tmp_path):
    result = run_command([sys.executable, str(REPO / "benchmarks" / script), *args],
                         cwd=tmp_path, timeout=240)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    figures = last_json_line(result.stdout)
    assert keys <= set(figures)
    assert all(value > 0 for key, value in figures.items()
               if key in keys and isinstance(value, (int, float)))
