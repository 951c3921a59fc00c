"""Precision: what auto chooses, what a policy does to Keras, and training under each."""

import keras
import pytest

from tfdist.app import train
from tfdist.cluster import ClusterInfo, GpuInfo, TpuInfo
from tfdist.config import Precision, Strategy, load_config
from tfdist.errors import ConfigError
from tfdist.precision import PrecisionPolicy, resolve_precision
from tfdist.runner import Runner

CPU = ClusterInfo()
CPU_BF16 = ClusterInfo(cpu_bf16=True)
A100 = ClusterInfo(gpus=(GpuInfo("A100", (8, 0)), GpuInfo("A100", (8, 0))))
V100 = ClusterInfo(gpus=(GpuInfo("V100", (7, 0)),))
MIXED_GPUS = ClusterInfo(gpus=(GpuInfo("H100", (9, 0)), GpuInfo("T4", (7, 5))))
TPU = ClusterInfo(tpu=TpuInfo("local", "TPU VM"))


@pytest.mark.parametrize("requested, strategy, cluster, expected", [
    (None, Strategy.ONE_DEVICE, CPU_BF16, Precision.FLOAT32),
    (None, Strategy.TPU, TPU, Precision.MIXED_BFLOAT16),
    (Precision.MIXED_FLOAT16, Strategy.MIRRORED, CPU, Precision.MIXED_FLOAT16),
    (Precision.AUTO, Strategy.TPU, TPU, Precision.MIXED_BFLOAT16),
    (Precision.AUTO, Strategy.MIRRORED, A100, Precision.MIXED_BFLOAT16),
    (Precision.AUTO, Strategy.ONE_DEVICE, V100, Precision.MIXED_FLOAT16),
    (Precision.AUTO, Strategy.MIRRORED, MIXED_GPUS, Precision.MIXED_FLOAT16),
    (Precision.AUTO, Strategy.ONE_DEVICE, CPU, Precision.FLOAT32),
])
def test_resolution(requested, strategy, cluster, expected):
    policy = resolve_precision(requested, strategy=strategy, cluster=cluster)
    assert policy.precision is expected
    assert policy.reason


def test_float16_on_tpu_is_refused_also_when_auto_chose_the_tpu():
    with pytest.raises(ConfigError, match="mixed_float16 does not run on TPU"):
        resolve_precision(Precision.MIXED_FLOAT16, strategy=Strategy.TPU, cluster=TPU)


def test_policy_is_concrete():
    with pytest.raises(ValueError):
        PrecisionPolicy(Precision.AUTO)


@pytest.mark.parametrize("precision, compute", [
    ("float32", "float32"), ("mixed_float16", "float16"), ("mixed_bfloat16", "bfloat16")])
@pytest.mark.parametrize("strategy", ["one_device", "mirrored"])
def test_runner_scope_sets_compute_dtype_keeps_float32_variables_and_restores(
        precision, compute, strategy):
    runner = Runner(load_config(overrides={"strategy": strategy, "precision": precision,
                                           "mirrored.cpu_replicas": 2}))
    with runner.scope():
        model = train.build_reference_model(8, 3)
        optimizer = runner.optimizer(keras.optimizers.SGD(0.1))
    assert keras.config.dtype_policy().name == "float32"  # restored after the scope
    hidden = model.get_layer("hidden_0")
    assert hidden.compute_dtype == compute
    assert all(v.dtype == "float32" for v in model.weights)
    assert model.get_layer("probabilities").compute_dtype == "float32"
    assert isinstance(optimizer, keras.optimizers.LossScaleOptimizer) == (
        precision == "mixed_float16")


@pytest.mark.parametrize("strategy", ["one_device", "mirrored"])
@pytest.mark.slow
def test_mixed_policies_train_within_two_points_of_float32(strategy, tmp_path):
    accuracy = {}
    for precision in ("float32", "mixed_float16", "mixed_bfloat16"):
        config = load_config(overrides={
            "strategy": strategy, "precision": precision, "seed": 1,
            "mirrored.cpu_replicas": 2, "train.epochs": 10,
            "train.output_dir": str(tmp_path / precision)})
        result = train.run(config)
        assert result["precision"] == precision
        accuracy[precision] = result["accuracy"]
    assert accuracy["float32"] > 0.93, accuracy
    for precision in ("mixed_float16", "mixed_bfloat16"):
        assert abs(accuracy[precision] - accuracy["float32"]) <= 0.02, accuracy
