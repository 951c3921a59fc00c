"""precision: auto on a CPU with bfloat16 instructions follows a measured matmul probe."""

import json
import os

import pytest

from tfdist import bfloat16_probe
from tfdist.bfloat16_probe import MatmulProbe
from tfdist.cluster import ClusterInfo, detect_cluster
from tfdist.config import Precision, Strategy
from tfdist.precision import cpu_precision, resolve_precision

# Figures measured by benchmarks/precision.py's bare matmul: an Intel Xeon (Sapphire Rapids,
# AVX512_BF16, AMX not exposed to the VM) and an AMD EPYC with AVX512_BF16.
SAPPHIRE_RAPIDS = dict(float32_gflops=274.0, bfloat16_gflops=159.0)
EPYC = dict(float32_gflops=202.0, bfloat16_gflops=386.0)


def cluster_with_cached_figures(cache_dir, figures):
    """A CPU with bfloat16 flags whose probe figures are already in its cache."""
    cluster = ClusterInfo(cpu_bf16=True, cpu_model="test CPU", cpu_cores=2,
                          cache_dir=str(cache_dir))
    os.makedirs(cache_dir, exist_ok=True)
    with open(os.path.join(cache_dir, bfloat16_probe.CACHE_FILE), "w") as stream:
        json.dump({bfloat16_probe.cache_key(cluster): figures}, stream)
    return cluster


@pytest.mark.parametrize("figures, expected", [(SAPPHIRE_RAPIDS, Precision.FLOAT32),
                                               (EPYC, Precision.MIXED_BFLOAT16)])
def test_auto_takes_bfloat16_only_where_it_measured_faster(figures, expected, tmp_path):
    assert cpu_precision(MatmulProbe(**figures)).precision is expected
    cluster = cluster_with_cached_figures(tmp_path, figures)
    policy = resolve_precision(Precision.AUTO, strategy=Strategy.ONE_DEVICE, cluster=cluster)
    assert policy.precision is expected
    assert "GFLOP/s" in policy.reason  # both figures are in the reason the Runner logs


@pytest.mark.multiprocess
def test_the_probe_measures_once_per_machine_and_is_read_back(tmp_path):
    machine = detect_cluster(probe_gpus=False)
    cluster = ClusterInfo(cpu_bf16=True, cpu_model=machine.cpu_model,
                          cpu_cores=machine.cpu_cores, cache_dir=str(tmp_path))
    measured = bfloat16_probe.cached_probe(cluster)
    assert not measured.cached
    assert measured.float32_gflops > 0 and measured.bfloat16_gflops > 0
    again = bfloat16_probe.cached_probe(cluster)
    assert again.cached
    assert (again.float32_gflops, again.bfloat16_gflops) == (measured.float32_gflops,
                                                             measured.bfloat16_gflops)
    policy = resolve_precision(Precision.AUTO, strategy=Strategy.ONE_DEVICE, cluster=cluster)
    assert (policy.precision is Precision.MIXED_BFLOAT16) == measured.bfloat16_faster


def test_a_cpu_without_bfloat16_flags_is_not_probed(tmp_path):
    cluster = ClusterInfo(cpu_bf16=False, cache_dir=str(tmp_path))
    policy = resolve_precision(Precision.AUTO, strategy=Strategy.ONE_DEVICE, cluster=cluster)
    assert policy.precision is Precision.FLOAT32
    assert not list(tmp_path.iterdir())
