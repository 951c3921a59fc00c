"""`parameter_server`: asynchronous training with variables on parameter servers.

`ParameterServerStrategy` under Keras 3 `model.fit`. The cluster comes from
TF_CONFIG (what `tfdist launch --ps`, Kubeflow's TFJob and Vertex AI set): one
`chief` that coordinates, `worker` tasks that compute, `ps` tasks that hold the
variables. Every task runs the same command. On a worker or a parameter server
the Runner starts this task's server and serves until the process is stopped,
so the rest of the script never runs there; on the chief it returns, and
`model.fit` schedules steps on the workers (see `coordinated_fit.py` beside this module).

Variables larger than `parameter_server.min_shard_bytes` are split row-wise
into shards on different parameter servers (at most `max_shards`, by default
one per server), so one server does not hold, or serve, a whole embedding.

Example:

    # tfdist launch -n 2 --ps 1 -- tfdist train --strategy parameter_server
    runner = tfdist.Runner(tfdist.load_config(overrides={"strategy": "parameter_server"}))
    runner.is_chief   # True: only the chief gets past the line above
"""

from __future__ import annotations

from typing import NoReturn

import tensorflow as tf
from absl import logging

from tfdist.adapters.base import Adapter
from tfdist.adapters.parameter_server import coordinated_fit
from tfdist.cluster import ClusterInfo, TFConfigInfo
from tfdist.config import Config
from tfdist.errors import ConfigError
from tfdist.patches import PARAMETER_SERVER, keras_trainer
from tfdist.resume.shuffling import EpochShuffle
from tfdist.startup import wait_for_peers


class ParameterServerAdapter(Adapter):
    """Builds `ParameterServerStrategy` on the chief; serves on workers and ps tasks.

    Raises:
        ConfigError: no TF_CONFIG with a chief, workers and ps tasks, or an option
            this strategy does not support.
    """

    zero_refusal = ("its variables and their optimizer state live on the parameter servers "
                    "already, split among them, not replicated on the workers; set "
                    "zero_stage 0")
    model_parallel_refusal = (
        "its variables live on the parameter servers, placed by the strategy, and the "
        "workers' steps run on one device each; use strategy horovod (each rank one copy of "
        "the model over its devices) or one_device")

    patches = PARAMETER_SERVER

    def __init__(self, config: Config, cluster: ClusterInfo):
        super().__init__(config, cluster)
        self._tf_config = _checked_tf_config(cluster.tf_config)
        if config.accumulation_steps > 1:
            raise ConfigError("accumulation_steps must be 1 under parameter_server: workers "
                              "update the variables asynchronously, each step on its own, so "
                              "there is no set of steps to accumulate over; use a larger "
                              "train.global_batch_size instead. "
                              f"Received: accumulation_steps={config.accumulation_steps}")

    def create_strategy(self) -> tf.distribute.Strategy:
        # The routed fit/evaluate/predict (this strategy's patches) run this loop.
        keras_trainer.set_parameter_server_loop(coordinated_fit)
        tf_config = self._tf_config
        spec = tf.train.ClusterSpec({k: list(v) for k, v in tf_config.cluster.items()})
        if tf_config.task_type in ("worker", "ps"):
            _serve(spec, tf_config.task_type, tf_config.task_index, self.inter_op_threads())
        # The chief reaches every server first: TensorFlow's connection to a task that
        # never starts blocks, deaf to signals (see tfdist.startup).
        wait_for_peers(tf_config.cluster["chief"][0],
                       {f"{kind}:{index}": address for kind in ("worker", "ps")
                        for index, address in enumerate(tf_config.cluster[kind])},
                       self.config.cluster.startup_timeout_seconds, listen=False)
        resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
            spec, task_type=tf_config.task_type, task_id=tf_config.task_index, rpc_layer="grpc")
        strategy = tf.distribute.ParameterServerStrategy(
            resolver, variable_partitioner=self._partitioner())
        # The one coordinator of this strategy; model.fit finds it again.
        tf.distribute.coordinator.ClusterCoordinator(strategy)
        return strategy

    @property
    def is_chief(self) -> bool:
        """The chief, which coordinates; workers and servers never get this far."""
        return self._tf_config.task_type == "chief"

    @property
    def num_workers(self) -> int:
        """Worker tasks that run scheduled steps."""
        return len(self._tf_config.cluster["worker"])

    def inter_op_threads(self) -> int:
        """At least workers + 1: the coordinator holds a thread per worker's remote call."""
        return max(self.cluster.cpu_cores, self.num_workers + 1)

    def shuffled(self, dataset: tf.data.Dataset, shuffle: EpochShuffle | None) -> tf.data.Dataset:
        """tf.data's own reshuffling, seeded: each worker rebuilds the dataset's graph,
        which cannot reach the chief's epoch variable. Workers take batches
        asynchronously, so the order is not reproducible anyway."""
        if shuffle is None:
            return dataset
        return dataset.shuffle(shuffle.buffer_size, seed=shuffle.seed,
                               reshuffle_each_iteration=True)

    def server_addresses(self) -> list[str]:
        return [address for addresses in self._tf_config.cluster.values()
                for address in addresses]

    def _partitioner(self) -> tf.distribute.experimental.partitioners.Partitioner | None:
        options = self.config.parameter_server
        max_shards = options.max_shards or len(self._tf_config.cluster["ps"])
        if max_shards == 1:
            return None
        return tf.distribute.experimental.partitioners.MinSizePartitioner(
            min_shard_bytes=options.min_shard_bytes, max_shards=max_shards)


def _checked_tf_config(tf_config: TFConfigInfo | None) -> TFConfigInfo:
    if tf_config is None:
        raise ConfigError("strategy parameter_server found no cluster: set TF_CONFIG with "
                          "chief, worker and ps tasks (tfdist launch -n 2 --ps 1 -- ... does). "
                          "Received: no TF_CONFIG")
    missing = [task for task in ("chief", "worker", "ps") if not tf_config.cluster.get(task)]
    if missing:
        raise ConfigError(f"strategy parameter_server needs a chief, workers and ps tasks in "
                          f"TF_CONFIG; it has no {' or '.join(missing)}. Use tfdist launch -n N "
                          f"--ps M, or multi_worker for a cluster of workers only. Received: "
                          f"cluster with {', '.join(sorted(tf_config.cluster))}")
    if tf_config.task_type not in ("chief", "worker", "ps"):
        raise ConfigError(f"strategy parameter_server runs chief, worker and ps tasks; "
                          f"TF_CONFIG makes this process a '{tf_config.task_type}'. "
                          f"Received: task.type={tf_config.task_type}")
    return tf_config


def _serve(spec: tf.train.ClusterSpec, task_type: str, task_index: int,
           inter_op_threads: int) -> NoReturn:
    """Runs this task's server until the process is stopped; the chief drives it."""
    server_config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=inter_op_threads)
    server = tf.distribute.Server(spec, job_name=task_type, task_index=task_index,
                                  config=server_config, protocol="grpc", start=True)
    logging.info("tfdist: %s:%d serving at %s until stopped", task_type, task_index,
                 server.target)
    server.join()
    raise SystemExit(0)  # join() returns only if the server stops by itself.
