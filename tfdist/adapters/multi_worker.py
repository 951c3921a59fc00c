"""`multi_worker`: synchronous data parallelism across processes and machines.

`MultiWorkerMirroredStrategy` under Keras 3 `model.fit`. The cluster comes from
the config's `multi_worker.workers`, else from TF_CONFIG (what Kubeflow's TFJob
and `tfdist launch` set), else from Slurm. Every worker runs the same script;
worker 0 (or the `chief` task) is the chief.

Example:

    # Two processes, each with its TF_CONFIG:
    #   tfdist launch -n 2 -- tfdist train --strategy multi_worker
    runner = tfdist.Runner(tfdist.load_config(overrides={"strategy": "multi_worker"}))
    runner.num_replicas   # 2
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator, Sequence

import tensorflow as tf
from absl import logging

from tfdist.adapters.base import (Adapter, DatasetSource, batched, call_dataset_function,
                                  check_global_batch_size)
from tfdist.config import DEFAULT_COLLECTIVE_TIMEOUT_SECONDS, AutoShard, Communication
from tfdist.devices import split_cpu
from tfdist.errors import ConfigError
from tfdist.patches import MULTI_WORKER, tensorflow_distribute
from tfdist.resume.preemption import CoordinatedStop, StopAgreement
from tfdist.resume.shuffling import EpochShuffle
from tfdist.startup import wait_for_peers

# How long a process waits at a barrier for the others: checkpoint reads and writes,
# whose length depends on storage, happen between barriers, outside the collectives'
# timeout. A barrier still fails at once when a peer is known to be gone.
_BARRIER_TIMEOUT_MS = 60 * 60 * 1000

_IMPLEMENTATIONS = {
    Communication.AUTO: tf.distribute.experimental.CommunicationImplementation.AUTO,
    Communication.RING: tf.distribute.experimental.CommunicationImplementation.RING,
    Communication.NCCL: tf.distribute.experimental.CommunicationImplementation.NCCL,
}
_SHARD_POLICIES = {
    AutoShard.AUTO: tf.data.experimental.AutoShardPolicy.AUTO,
    AutoShard.DATA: tf.data.experimental.AutoShardPolicy.DATA,
    AutoShard.FILE: tf.data.experimental.AutoShardPolicy.FILE,
    AutoShard.OFF: tf.data.experimental.AutoShardPolicy.OFF,
}


class MultiWorkerAdapter(Adapter):
    """Builds `MultiWorkerMirroredStrategy` from the detected or configured cluster."""

    zero_refusal = ("Keras's optimizer under tf.distribute creates each slot as one mirrored "
                    "variable and updates it in one cross-replica step, the same on every "
                    "replica, so no replica can hold a partition of its own; shard with one "
                    "process per device: strategy horovod (mpirun -np N ... --strategy "
                    "horovod)")

    patches = MULTI_WORKER
    patches_while_building = (tensorflow_distribute.MULTI_WORKER_CPU_REPLICAS,)
    _barriers = 0  # Barriers passed so far; each gets a name of its own.

    def create_strategy(self) -> tf.distribute.Strategy:
        resolver = self._cluster_resolver()
        options = self.config.multi_worker
        tasks = self._task_addresses(resolver)
        own = (resolver.task_type, resolver.task_id)
        # Before TensorFlow's own start-up, which blocks deaf to signals until all are there.
        wait_for_peers(tasks[own], {f"{kind}:{index}": address
                                    for (kind, index), address in tasks.items() if
                                    (kind, index) != own},
                       self.config.cluster.startup_timeout_seconds)
        if not options.timeout_seconds and self._expected_workers() > 1:
            logging.warning("tfdist: multi_worker.timeout_seconds=0: a worker that is stuck "
                            "(alive but not training) leaves every other worker waiting in "
                            "a collective for ever. Set a timeout, such as %g seconds.",
                            DEFAULT_COLLECTIVE_TIMEOUT_SECONDS)
        communication = tf.distribute.experimental.CommunicationOptions(
            implementation=_IMPLEMENTATIONS[options.communication],
            bytes_per_pack=options.bytes_per_pack,
            timeout_seconds=options.timeout_seconds or None)
        try:
            with _cpu_replicas_per_worker(options.cpu_replicas):
                return tf.distribute.MultiWorkerMirroredStrategy(
                    cluster_resolver=resolver, communication_options=communication)
        except RuntimeError as error:
            if "program startup" not in str(error):
                raise
            raise ConfigError("strategy multi_worker must start before TensorFlow runs any op "
                              "(it configures collectives at start-up); create the Runner "
                              "first in your program. Received: TensorFlow already "
                              "running") from None

    @property
    def is_chief(self) -> bool:
        """The chief task, or worker 0 when the cluster has no chief."""
        resolver = self.strategy.cluster_resolver
        if "chief" in resolver.cluster_spec().as_dict():
            return resolver.task_type == "chief"
        return resolver.task_id == 0

    def inter_op_threads(self) -> int:
        """At least one more than the processes on this machine, or collectives deadlock."""
        return max(self.cluster.cpu_cores, self._expected_workers() + 1)

    def distribute_dataset(self, source: DatasetSource, global_batch_size: int, *,
                           drop_remainder: bool = True,
                           shuffle: EpochShuffle | None = None) -> Any:
        """Global batches; each worker takes its replicas' slices of every step's batch.

        Args:
            source: An unbatched `tf.data.Dataset`; a function of
                `tf.distribute.InputContext` is called on each worker with its own
                pipeline id and must shard by it itself.
            global_batch_size: Examples per step across all replicas of all workers.
            drop_remainder: Drop a final partial global batch.
            shuffle: Shuffles each epoch in the order of (seed, epoch), the same
                order on every worker, before each takes its slices.
        """
        strategy = self.strategy
        check_global_batch_size(global_batch_size, strategy.num_replicas_in_sync)
        if isinstance(source, tf.data.Dataset):
            options = tf.data.Options()
            options.experimental_distribute.auto_shard_policy = _SHARD_POLICIES[
                self.config.multi_worker.auto_shard]
            return batched(self.shuffled(source, shuffle), global_batch_size,
                           drop_remainder).with_options(options)
        if callable(source) and strategy.extended._num_devices_per_worker > 1:
            # TensorFlow counts such a dataset's cardinality in per-replica batches and
            # Keras 3 takes that as steps (see Adapter.distribute_dataset): with more
            # than one replica per worker, fit would take phantom steps.
            raise ConfigError("a dataset function with more than one replica per worker is "
                              "not supported yet; pass an unbatched tf.data.Dataset instead. "
                              f"Received: multi_worker.cpu_replicas="
                              f"{self.config.multi_worker.cpu_replicas}")
        return strategy.distribute_datasets_from_function(
            lambda context: batched(self.shuffled(call_dataset_function(source, context),
                                                  shuffle),
                                    context.get_per_replica_batch_size(global_batch_size),
                                    drop_remainder))

    # --- checkpoints and preemption ------------------------------------------------------

    @property
    def num_processes(self) -> int:
        return len(self._worker_tasks())

    def process_sum(self, values: Sequence[float]) -> list[float]:
        """Sums over workers with the strategy's own all-reduce (each worker counted once)."""
        strategy = self.strategy
        local = tf.constant([float(value) for value in values], tf.float64)
        per_worker = strategy.extended._num_devices_per_worker
        summed = self._sum_over_replicas(local).numpy()
        return [float(value) / per_worker for value in summed]

    @functools.cached_property
    def _sum_over_replicas(self) -> Any:
        # In a tf.function, traced once per length: this strategy's eager collectives are
        # slow and warn.
        strategy = self.strategy

        @tf.function
        def all_reduce(value: tf.Tensor) -> tf.Tensor:
            return strategy.reduce(tf.distribute.ReduceOp.SUM,
                                   strategy.run(tf.identity, args=(value,)), axis=None)

        return all_reduce

    def barrier(self, name: str) -> None:
        """A coordination-service barrier: no collective, and a long timeout of its own."""
        from tensorflow.python.eager import context

        self._barriers += 1  # Every worker passes the same barriers in the same order.
        context.context().wait_at_barrier(f"{name}/{self._barriers}", _BARRIER_TIMEOUT_MS)

    def stop_agreement(self, run_key: str) -> StopAgreement:
        resolver = self.strategy.cluster_resolver
        index = self._worker_tasks().index((resolver.task_type, resolver.task_id))
        return CoordinatedStop(index, self.num_processes, run_key)

    def server_addresses(self) -> list[str]:
        options = self.config.multi_worker
        if options.workers:
            return list(options.workers)
        if self.cluster.tf_config is not None:
            return [address for addresses in self.cluster.tf_config.cluster.values()
                    for address in addresses]
        if self.cluster.slurm is not None:
            return self.cluster.slurm.worker_addresses(options.slurm_port_base)
        return []

    @staticmethod
    def _task_addresses(resolver: Any) -> dict[tuple[str, int], str]:
        """(task type, index) of every training process to its `host:port`."""
        spec = resolver.cluster_spec().as_dict()
        return {(task_type, index): address for task_type in ("chief", "worker")
                for index, address in enumerate(spec.get(task_type, ()))}

    def _worker_tasks(self) -> list[tuple[str, int]]:
        """(task type, index) of every training process, the chief first."""
        return list(self._task_addresses(self.strategy.cluster_resolver))

    def _expected_workers(self) -> int:
        options = self.config.multi_worker
        if options.workers:
            return len(options.workers)
        if self.cluster.tf_config is not None:
            return self.cluster.tf_config.num_workers
        if self.cluster.slurm is not None:
            return self.cluster.slurm.num_tasks
        return 1

    def _cluster_resolver(self) -> tf.distribute.cluster_resolver.ClusterResolver:
        options = self.config.multi_worker
        accelerators = {"GPU": len(self.cluster.gpus)} if self.cluster.gpus else None
        if options.workers:
            spec = tf.train.ClusterSpec({"worker": list(options.workers)})
            return tf.distribute.cluster_resolver.SimpleClusterResolver(
                spec, task_type="worker", task_id=options.task_index,
                num_accelerators=accelerators, rpc_layer="grpc")
        tf_config = self.cluster.tf_config
        if tf_config is not None:
            if "ps" in tf_config.cluster:
                raise ConfigError(f"strategy multi_worker trains on chief and worker tasks "
                                  f"only, and TF_CONFIG names "
                                  f"{len(tf_config.cluster['ps'])} ps tasks, which would wait "
                                  f"for ever: use --strategy parameter_server (or auto), or "
                                  f"drop the ps tasks (tfdist launch without --ps). "
                                  f"Received: cluster with {', '.join(sorted(tf_config.cluster))}")
            if tf_config.task_type not in ("chief", "worker"):
                raise ConfigError(f"multi_worker runs on chief and worker tasks; TF_CONFIG makes "
                                  f"this process a '{tf_config.task_type}'. Use "
                                  f"parameter_server for clusters with ps tasks. "
                                  f"Received: task.type={tf_config.task_type}")
            spec = tf.train.ClusterSpec({k: list(v) for k, v in tf_config.cluster.items()})
            return tf.distribute.cluster_resolver.SimpleClusterResolver(
                spec, task_type=tf_config.task_type, task_id=tf_config.task_index,
                num_accelerators=accelerators, rpc_layer="grpc")
        if self.cluster.slurm is not None:
            spec = tf.train.ClusterSpec({"worker": self.cluster.slurm.worker_addresses(
                options.slurm_port_base)})
            return tf.distribute.cluster_resolver.SimpleClusterResolver(
                spec, task_type="worker", task_id=self.cluster.slurm.proc_id,
                num_accelerators=accelerators, rpc_layer="grpc")
        raise ConfigError("strategy multi_worker found no cluster: set TF_CONFIG (or run under "
                          "tfdist launch, Kubeflow or Slurm), or list multi_worker.workers. "
                          "Received: no TF_CONFIG, no Slurm job, multi_worker.workers=[]")


@contextlib.contextmanager
def _cpu_replicas_per_worker(replicas: int) -> Iterator[None]:
    """While a strategy is built, gives each worker `replicas` logical CPU devices.

    MultiWorkerMirroredStrategy puts one replica on a worker without GPUs (its
    `_initialize_local_devices`, called only while the strategy is built). The patch
    gives it the logical CPU devices instead, so a machine without GPUs runs the code
    path of several GPUs per worker.
    """
    if not replicas:
        yield
        return
    split_cpu(replicas, key="multi_worker.cpu_replicas")
    with tensorflow_distribute.MULTI_WORKER_CPU_REPLICAS.applied(replicas=replicas):
        yield
