"""The TPU adapter without a TPU: resolver arguments, defaults, and the errors when absent.

No TPU was available to run TPUStrategy itself; everything before it runs here.
"""

import pytest

from tfdist.adapters.tpu import TPUAdapter, resolver_arguments
from tfdist.cluster import ClusterInfo, TpuInfo
from tfdist.config import Precision, TPUConfig, load_config
from tfdist.errors import ConfigError
from tfdist.runner import Runner


def test_resolver_arguments_from_the_config():
    options = TPUConfig(name="my-tpu", zone="us-central2-b", project="research")
    assert resolver_arguments(options, ClusterInfo()) == {
        "tpu": "my-tpu", "zone": "us-central2-b", "project": "research"}


def test_resolver_arguments_from_the_environment():
    cluster = ClusterInfo(tpu=TpuInfo("grpc://10.0.0.2:8470", "COLAB_TPU_ADDR"))
    assert resolver_arguments(TPUConfig(), cluster) == {
        "tpu": "grpc://10.0.0.2:8470", "zone": None, "project": None}


def test_config_name_wins_over_the_environment():
    cluster = ClusterInfo(tpu=TpuInfo("env-tpu", "TPU_NAME"))
    assert resolver_arguments(TPUConfig(name="local"), cluster)["tpu"] == "local"


def test_no_tpu_anywhere_is_one_line_before_contacting_anything():
    with pytest.raises(ConfigError, match="found no TPU") as raised:
        resolver_arguments(TPUConfig(), ClusterInfo())
    assert "\n" not in str(raised.value)


def test_runner_without_a_tpu():
    with pytest.raises(ConfigError, match="found no TPU"):
        Runner(load_config(overrides={"strategy": "tpu"}), cluster=ClusterInfo())


def test_local_tpu_that_is_not_there_fails_in_tensorflow_and_says_so():
    # 'local' asks TensorFlow to initialise TPU chips on this host: a real call, no network.
    adapter = TPUAdapter(load_config(overrides={"strategy": "tpu", "tpu.name": "local"}),
                         ClusterInfo())
    with pytest.raises(ConfigError, match="could not start the TPU 'local'") as raised:
        adapter.create_strategy()
    assert "\n" not in str(raised.value)


def test_tpu_precision_defaults_to_bfloat16_and_refuses_float16():
    from tfdist.precision import resolve_precision
    from tfdist.config import Strategy

    tpu = ClusterInfo(tpu=TpuInfo("local", "TPU VM"))
    assert resolve_precision(None, strategy=Strategy.TPU, cluster=tpu).precision is \
        Precision.MIXED_BFLOAT16
    assert load_config("tpu").precision is Precision.MIXED_BFLOAT16
    with pytest.raises(ConfigError, match="mixed_float16 does not run on TPU"):
        load_config(overrides={"strategy": "tpu", "precision": "mixed_float16"})


def test_dataset_drops_the_remainder_for_static_shapes():
    # distribute_dataset needs only the replica count; check the batching rule with a
    # one_device strategy standing in for the TPU's.
    import tensorflow as tf

    adapter = TPUAdapter(load_config(overrides={"strategy": "tpu"}), ClusterInfo())
    adapter.strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    batches = adapter.distribute_dataset(tf.data.Dataset.range(10), 4, drop_remainder=False)
    assert [b.shape[0] for b in batches] == [4, 4]
