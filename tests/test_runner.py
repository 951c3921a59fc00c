"""The Runner: auto choice, scope, datasets, threads, the resolved config."""

import logging

import numpy as np
import pytest
import tensorflow as tf
import yaml

from tfdist.cluster import ClusterInfo, GpuInfo, MpiInfo, SlurmInfo, TpuInfo, parse_tf_config
from tfdist.config import Strategy, load_config
from tfdist.errors import ConfigError
from tfdist.runner import Runner, choose_strategy


@pytest.mark.parametrize("cluster, expected", [
    (ClusterInfo(), Strategy.ONE_DEVICE),
    (ClusterInfo(gpus=(GpuInfo("A100", (8, 0)),)), Strategy.ONE_DEVICE),
    (ClusterInfo(gpus=(GpuInfo("A100", (8, 0)),) * 4), Strategy.MIRRORED),
    (ClusterInfo(tpu=TpuInfo("local", "TPU VM")), Strategy.TPU),
    (ClusterInfo(tf_config=parse_tf_config(
        '{"cluster": {"worker": ["a:1", "b:2"]}, "task": {"type": "worker", "index": 0}}')),
     Strategy.MULTI_WORKER),
    (ClusterInfo(tf_config=parse_tf_config(
        '{"cluster": {"chief": ["c:0"], "worker": ["a:1"], "ps": ["p:2"]},'
        ' "task": {"type": "ps", "index": 0}}')), Strategy.PARAMETER_SERVER),
    (ClusterInfo(mpi=MpiInfo(0, 2, 0, 2, "openmpi")), Strategy.HOROVOD),
    (ClusterInfo(slurm=SlurmInfo("1", 0, 4, 0, "n[1-4]")), Strategy.MULTI_WORKER),
])
def test_auto_choice(cluster, expected):
    strategy, reason = choose_strategy(cluster)
    assert strategy is expected
    assert reason


def test_auto_on_this_machine_resolves_to_a_concrete_strategy():
    runner = Runner(load_config(overrides={"strategy": "auto"}), cluster=ClusterInfo())
    assert runner.strategy_name is Strategy.ONE_DEVICE
    assert runner.config.strategy is Strategy.ONE_DEVICE
    assert runner.num_replicas == 1 and runner.is_chief


def test_save_config_writes_the_resolved_config(tmp_path):
    from tests.test_bfloat16_probe import EPYC, cluster_with_cached_figures

    runner = Runner(load_config(overrides={"strategy": "auto", "precision": "auto"}),
                    cluster=cluster_with_cached_figures(tmp_path / "cache", EPYC))
    path = runner.save_config(tmp_path / "run")
    written = yaml.safe_load(open(path))
    assert written["strategy"] == "one_device"
    assert written["precision"] == "mixed_bfloat16"
    assert load_config(path) == runner.config
    assert not list((tmp_path / "run").glob(".config.yaml.*"))  # no temporary left behind


def test_dataset_from_a_function_of_input_context():
    runner = Runner(load_config(overrides={"strategy": "mirrored", "mirrored.cpu_replicas": 2}))
    seen = []

    def make(context):
        seen.append((context.num_input_pipelines, context.num_replicas_in_sync))
        return tf.data.Dataset.range(8)

    batches = runner.dataset(make, global_batch_size=4)
    batch = next(iter(runner.strategy.experimental_distribute_dataset(batches)))  # as Keras does
    parts = [t.numpy().tolist() for t in runner.strategy.experimental_local_results(batch)]
    assert parts == [[0, 1], [2, 3]]
    assert seen == [(1, 2)]


def test_dataset_rejects_what_is_not_a_dataset():
    runner = Runner(load_config(overrides={"strategy": "one_device"}))
    with pytest.raises(ConfigError, match="needs a tf.data.Dataset"):
        runner.dataset(np.zeros(4), global_batch_size=2)
    with pytest.raises(ConfigError, match="must return a tf.data.Dataset"):
        runner.dataset(lambda context: [1, 2], global_batch_size=2)


def test_optimizer_accepts_keras_identifiers_and_rejects_others():
    runner = Runner(load_config(overrides={"strategy": "one_device"}))
    assert type(runner.optimizer("adam")).__name__ == "Adam"
    with pytest.raises(ConfigError, match="needs a Keras optimizer"):
        runner.optimizer("not-an-optimizer")


def test_threads_after_the_runtime_started_is_a_clear_error():
    tf.constant(1.0) + 1.0  # The runtime is running.
    current = tf.config.threading.get_inter_op_parallelism_threads()
    with pytest.raises(ConfigError, match="threads.inter_op=.*runtime has already started"):
        Runner(load_config(overrides={"strategy": "one_device", "threads.inter_op": current + 3}))


def non_loopback_address():
    """An address of this machine's own that is not loopback, or None."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # UDP: picks the outgoing interface, sends nothing
        except OSError:
            return None
        address = probe.getsockname()[0]
    return None if address.startswith("127.") else address


@pytest.mark.parametrize("trusted", [False, True])
@pytest.mark.multiprocess
def test_a_cluster_beyond_loopback_warns_unless_the_network_is_trusted(trusted, tmp_path):
    import json
    import sys

    from tfdist.app.launch import free_ports
    from tests.conftest import run_command

    address = non_loopback_address()
    if address is None:
        pytest.skip("this machine has no network interface besides loopback")
    tf_config = {"cluster": {"worker": [f"{address}:{free_ports(1)[0]}"]},
                 "task": {"type": "worker", "index": 0}}
    code = ("import tfdist; tfdist.Runner(tfdist.load_config(overrides={"
            f"'strategy': 'multi_worker', 'trusted_network': {trusted}}}))")
    result = run_command([sys.executable, "-c", code], cwd=tmp_path,
                         env={"TF_CONFIG": json.dumps(tf_config)}, timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    warned = "gRPC servers run whatever any caller sends, without authentication"
    assert (warned in result.stderr) is not trusted
    assert (f"{address}:" in result.stderr) is not trusted


@pytest.mark.parametrize("host, loopback", [
    ("127.0.0.1", True), ("127.0.1.1", True), ("localhost", True), ("[::1]", True),
    ("10.0.0.7", False), ("192.0.2.2", False), ("no-such-host.invalid", False)])
def test_loopback_is_told_by_address_and_name(host, loopback):
    from tfdist.cluster import beyond_loopback, is_loopback

    assert is_loopback(host) is loopback
    assert beyond_loopback([f"{host}:2222"]) == ([] if loopback else [f"{host}:2222"])


def test_the_runner_names_the_patches_its_strategy_applied(caplog):
    from absl import logging as absl_logging

    from tfdist import patches

    def runner_log():
        caplog.clear()
        with caplog.at_level(logging.INFO):
            Runner(load_config(overrides={"strategy": "mirrored", "mirrored.cpu_replicas": 2}))
        return caplog.text

    patches.undo_all()
    verbosity = absl_logging.get_verbosity()
    absl_logging.set_verbosity(absl_logging.INFO)
    try:
        # mirrored's own patch is in place only while its strategy is built; every
        # strategy keeps the exact-update pair.
        exact = ("keras.optimizer.summed_before_clipping, "
                 "keras.optimizer.replica_sum_once")
        assert f"tfdist: patches active: {exact}\n" in runner_log()
        assert sorted(patches.active()) == sorted(patch.name for patch in patches.EXACT_UPDATES)
        patches.apply(patches.MULTI_WORKER)  # as a multi_worker Runner earlier in the process
        assert ("keras.trainer.multi_worker_symbolic_build, "
                "keras.trainer.multi_worker_metric_reduction") in runner_log()
    finally:
        absl_logging.set_verbosity(verbosity)
        patches.undo_all()


def test_a_checkpoint_dir_that_is_not_a_path_is_one_line():
    runner = Runner(load_config(overrides={"strategy": "one_device"}), cluster=ClusterInfo())
    with pytest.raises(ConfigError) as raised:
        runner.callbacks(checkpoint_dir=123)
    assert str(raised.value) == ("checkpoint_dir must be a folder's path (a str or a "
                                 "pathlib.Path). Received: checkpoint_dir=123")


def test_model_devices_read_before_the_strategy_is_built_says_so_in_one_line():
    # The strategy decides which GPUs the process sees (Horovod pins each rank's), so the
    # model's devices are known only after it; read earlier they used to be () silently.
    from tfdist import registry

    config = load_config(overrides={"strategy": "one_device", "model_parallel.devices": 2})
    adapter = registry.get("one_device")(config, ClusterInfo())
    with pytest.raises(RuntimeError, match="known once the strategy is built"):
        adapter.model_devices
