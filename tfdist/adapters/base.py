"""The small base class every strategy adapter stands on.

An adapter turns a `Config` and a `ClusterInfo` into one `tf.distribute`
strategy, and supplies what `model.fit` needs under it: input distribution,
an optimizer wrapper, callbacks. Subclasses implement `create_strategy` and
override only what differs. Adapters never import each other.

Example:

    class OneDeviceAdapter(Adapter):
        def create_strategy(self):
            return tf.distribute.OneDeviceStrategy("/cpu:0")
"""

from __future__ import annotations

import abc
import contextlib
import functools
from typing import Any, Callable, ContextManager, Sequence, Union

import tensorflow as tf

from tfdist import patches as tfdist_patches
from tfdist.cluster import ClusterInfo
from tfdist.config import Config
from tfdist.devices import model_devices
from tfdist.errors import ConfigError
from tfdist.patches import Patch
from tfdist.resume.preemption import LocalStop, StopAgreement
from tfdist.resume.shuffling import EpochShuffle

DatasetSource = Union[tf.data.Dataset, Callable[[tf.distribute.InputContext], tf.data.Dataset]]


class Adapter(abc.ABC):
    """Builds one strategy and adapts Keras `model.fit` to it.

    Args:
        config: The validated run config.
        cluster: What `tfdist.cluster.detect_cluster` found.
    """

    # The fixes to Keras and TensorFlow this strategy needs (`tfdist.patches`), besides
    # `EXACT_UPDATES`, which every strategy needs; applied just before the strategy is
    # built, each acts only where its bug applies.
    patches: tuple[Patch, ...] = ()
    # Patches in place only while `create_strategy` builds the strategy (listed by
    # `tfdist env`; `create_strategy` applies them with `patch.applied()`).
    patches_while_building: tuple[Patch, ...] = ()
    # Whether the strategy trains in a single process; such a strategy is refused in a
    # process a launcher started as one of several (`check_single_process`).
    single_process: bool = False
    # Why this strategy cannot shard training state (`zero_stage` 1 or 2), for the one
    # line that refuses it; None where it can (`wrap_optimizer` shards then).
    zero_refusal: str | None = "it does not shard training state; use strategy horovod"
    # Why this strategy cannot spread one model over several devices of a process
    # (`model_parallel.devices` > 1), for the one line that refuses it; None where it can
    # (`model_devices` then lists them, and `create_strategy` builds no tf.distribute
    # strategy: its variable placement would override the stages').
    model_parallel_refusal: str | None = (
        "each of its replicas is one device, and tf.distribute gives a replica no group of "
        "devices (tensorflow/tensorflow#33645); use strategy horovod (each rank one copy of "
        "the model over its devices) or one_device")

    def __init__(self, config: Config, cluster: ClusterInfo):
        self.config = config
        self.cluster = cluster
        if config.zero_stage and self.zero_refusal:
            name = config.strategy.value
            raise ConfigError(f"zero_stage {config.zero_stage} cannot run under strategy {name}: "
                              f"{self.zero_refusal}. Received: strategy={name}, "
                              f"zero_stage={config.zero_stage}")
        devices = config.model_parallel.devices
        if devices > 1 and self.model_parallel_refusal:
            name = config.strategy.value
            raise ConfigError(f"model_parallel.devices {devices} cannot run under strategy "
                              f"{name}: {self.model_parallel_refusal}. Received: strategy="
                              f"{name}, model_parallel.devices={devices}")
        if self.single_process:
            check_single_process(config.strategy.value, cluster)

    @abc.abstractmethod
    def create_strategy(self) -> tf.distribute.Strategy:
        """Creates the strategy. Called once, by `strategy`."""

    @functools.cached_property
    def strategy(self) -> tf.distribute.Strategy:
        """The strategy, created on first use (after this adapter's patches are applied)."""
        tfdist_patches.apply((*tfdist_patches.EXACT_UPDATES, *self.patches))
        return self.create_strategy()

    @functools.cached_property
    def model_devices(self) -> tuple[str, ...]:
        """The devices this process spreads one model over (`model_parallel.devices` > 1:
        its first K visible GPUs, or K logical CPU devices), else ().

        Known once the strategy is built, which decides which GPUs this process sees.

        Raises:
            RuntimeError: read before `strategy`.
        """
        if "strategy" not in self.__dict__:
            raise RuntimeError("model_devices is known once the strategy is built (it decides "
                               "which GPUs this process sees); read adapter.strategy first")
        count = self.config.model_parallel.devices
        if count <= 1:
            return ()
        return model_devices(count, len(tf.config.get_visible_devices("GPU")))

    @property
    def is_chief(self) -> bool:
        """Whether this process does the run's single-writer work (logs, files)."""
        return True

    @property
    def num_replicas(self) -> int:
        """Replicas that train in sync, across all processes."""
        return self.strategy.num_replicas_in_sync

    def creation_scope(self) -> ContextManager[None]:
        """What `runner.scope()` enters besides the strategy's scope, around the model's
        creation (the horovod adapter at zero_stage 3: variables created sharded)."""
        return contextlib.nullcontext()

    def inter_op_threads(self) -> int:
        """Inter-op threads this strategy needs when the config sets none (0: TF's default)."""
        return 0

    def intra_op_threads(self) -> int:
        """Intra-op threads this strategy needs when the config sets none (0: TF's default)."""
        return 0

    def distribute_dataset(self, source: DatasetSource, global_batch_size: int, *,
                           drop_remainder: bool = True,
                           shuffle: EpochShuffle | None = None) -> Any:
        """Batches unbatched data so step i consumes the same examples under every strategy.

        Args:
            source: An unbatched `tf.data.Dataset`, or a function of
                `tf.distribute.InputContext` returning one (called once per input
                pipeline, with the context TensorFlow would give it; it may shard by
                `input_pipeline_id`).
            global_batch_size: Examples per step across all replicas.
            drop_remainder: Drop a final partial batch. Keras weights each replica's
                mean loss equally, so a partial batch split unevenly across replicas
                would give a gradient other than the batch mean.
            shuffle: Shuffles the unbatched examples of each epoch in the order of
                (seed, epoch), before batching. None: keep the source's order.

        Returns:
            A dataset of global batches; Keras splits each across the replicas in
            order, so replica r of step i gets the r-th slice of one_device's batch i.

        Raises:
            ConfigError: the batch does not divide across replicas, or the source
                is not a dataset.
        """
        replicas = self.num_replicas
        check_global_batch_size(global_batch_size, replicas)
        if isinstance(source, tf.data.Dataset):
            dataset = source
        else:
            # One process feeds every replica, so there is one input pipeline. The
            # function gets the context `distribute_datasets_from_function` would give
            # it, but the result is batched globally, as a plain dataset: TensorFlow
            # counts a from-function dataset's cardinality in per-replica batches, and
            # Keras 3 takes that count as steps per epoch. With 2 replicas it then runs
            # one step past the data each epoch, and that step still increments
            # `optimizer.iterations`, which shifts Adam's bias correction and every
            # learning-rate schedule (the symptom of tensorflow/tensorflow#30636).
            dataset = call_dataset_function(source, tf.distribute.InputContext(
                num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=replicas))
        return batched(self.shuffled(dataset, shuffle), global_batch_size, drop_remainder)

    def shuffled(self, dataset: tf.data.Dataset, shuffle: EpochShuffle | None) -> tf.data.Dataset:
        """`dataset` in the order of (seed, epoch), or as it is when `shuffle` is None."""
        return dataset if shuffle is None else shuffle.apply(dataset)

    def wrap_optimizer(self, optimizer: Any) -> Any:
        """Returns the optimizer this strategy trains with. The base keeps it as it is.

        Args:
            optimizer: The user's optimizer, not loss-scaled; loss scaling is
                wrapped around what this returns.
        """
        return optimizer

    def finite_reduce_fn(self) -> Callable[[Any], Any] | None:
        """Reduces "this replica's gradients are finite" across replicas, for loss scaling.

        The base all-reduces it in the strategy's replica context, so that every
        replica skips the same steps (see `tfdist.optimizers`); None with one replica.
        """
        if self.num_replicas == 1:
            return None

        def all_replicas_finite(finite: Any) -> Any:
            not_finite = tf.cast(tf.logical_not(finite), tf.float32)
            count = tf.distribute.get_replica_context().all_reduce(
                tf.distribute.ReduceOp.SUM, not_finite)
            return tf.equal(count, 0.0)

        return all_replicas_finite

    def callbacks(self) -> list[Any]:
        """Keras callbacks this strategy needs in `model.fit`. The base needs none."""
        return []

    # --- what checkpoints and preemption need: the base is one process --------------------

    @property
    def num_processes(self) -> int:
        """Processes that run the training loop together (all of them call what follows)."""
        return 1

    def process_sum(self, values: Sequence[float]) -> list[float]:
        """The sum of `values` over the processes, element by element (a collective)."""
        return [float(value) for value in values]

    def barrier(self, name: str) -> None:
        """Returns once every process has reached the barrier `name`."""

    def stop_agreement(self, run_key: str) -> StopAgreement:
        """How the processes agree on the step to stop at after a SIGTERM.

        Args:
            run_key: Unique to this `fit` among the cluster's fits.
        """
        return LocalStop()

    def prepare_checkpoint(self, variables: Sequence[Any]) -> ContextManager[None]:
        """Arranges `variables` for a save inside the block; the base has nothing to do.

        Args:
            variables: Every variable the checkpoint holds.
        """
        return contextlib.nullcontext()

    def after_restore(self, variables: Sequence[Any]) -> None:
        """Adjusts `variables`, just restored from a checkpoint every process read."""

    def run_elastic(self, train: Callable[[Any], Any]) -> Any:
        """Runs `train(state)` so that it goes on with the processes left when one is lost.

        Only `horovod` can (Horovod elastic); every other strategy restarts the whole
        group from a checkpoint, and the base refuses.

        Args:
            train: Takes the elastic state to commit to, and calls `model.fit`.
        """
        raise ConfigError(f"runner.run_elastic needs strategy horovod (under horovodrun "
                          f"--min-np ...); other strategies restart the whole group from "
                          f"a checkpoint instead. Received: strategy="
                          f"{self.config.strategy.value}")

    def server_addresses(self) -> list[str]:
        """`host:port` of the TensorFlow servers this strategy starts (none by default)."""
        return []


def batched(dataset: tf.data.Dataset, batch_size: int, drop_remainder: bool) -> tf.data.Dataset:
    """The dataset in batches, prefetched so input overlaps the step."""
    return dataset.batch(batch_size, drop_remainder=drop_remainder).prefetch(tf.data.AUTOTUNE)


def call_dataset_function(source: Any, context: tf.distribute.InputContext) -> tf.data.Dataset:
    """Calls a user's dataset function, or raises ConfigError for what is not one.

    Args:
        source: What the user passed as `runner.dataset`'s source (not a Dataset).
        context: The input pipeline's context.
    """
    if not callable(source):
        raise ConfigError("runner.dataset needs a tf.data.Dataset or a function of "
                          "tf.distribute.InputContext returning one. "
                          f"Received: {type(source).__name__}")
    dataset = source(context)
    if not isinstance(dataset, tf.data.Dataset):
        raise ConfigError("the dataset function must return a tf.data.Dataset. "
                          f"Received: {type(dataset).__name__}")
    return dataset


def check_global_batch_size(global_batch_size: Any, replicas: int) -> None:
    """Raises ConfigError unless the global batch is a positive multiple of the replicas."""
    if not isinstance(global_batch_size, int) or isinstance(global_batch_size, bool) \
            or global_batch_size < 1:
        raise ConfigError("global_batch_size must be an integer >= 1. "
                          f"Received: global_batch_size={global_batch_size!r}")
    if global_batch_size % replicas:
        nearest = max(replicas, round(global_batch_size / replicas) * replicas)
        raise ConfigError(f"global_batch_size {global_batch_size} does not divide across "
                          f"{replicas} replicas; use a multiple of {replicas} (e.g. {nearest}). "
                          f"Received: global_batch_size={global_batch_size}, "
                          f"replicas={replicas}")


def check_single_process(strategy: str, cluster: ClusterInfo) -> None:
    """Refuses a one-process strategy in one of several processes a launcher started.

    Each process would train on its own and write the same files: `tfdist launch -n 2`,
    `mpirun -np 2` or `srun -n 2` around `--strategy mirrored` is a mistake to stop at once.

    Args:
        strategy: The strategy's name, for the message.
        cluster: Where this process runs.

    Raises:
        ConfigError: this process is one of several.
    """
    several = _one_of_several(cluster)
    if several is None:
        return
    _, why, use = several
    raise ConfigError(f"strategy {strategy} trains in one process, but {why}: each would train "
                      f"alone and overwrite the others' files. Use --strategy {use} (or auto), "
                      f"or start one process. Received: strategy={strategy}, {why}")


def check_horovod_world(size: int, cluster: ClusterInfo) -> bool:
    """Refuses a one-rank Horovod world in one of several processes; True for a lone rank.

    Horovod's ranks come from its own launcher (mpirun, horovodrun): the tasks of
    `tfdist launch`, a TFJob or `srun` without MPI each see a world of 1 and would train
    alone.

    Args:
        size: Horovod's world size, after `hvd.init()`.
        cluster: Where this process runs.

    Returns:
        Whether this process is a lone rank (size 1, started alone).

    Raises:
        ConfigError: size 1 while this process is one of several tasks.
    """
    if size != 1:
        return False
    several = _one_of_several(cluster)
    if several is None:
        return True
    tasks, why, _ = several
    raise ConfigError(f"strategy horovod sees 1 rank, but {why}: each would train alone and "
                      f"overwrite the others' files. Start Horovod's ranks with its own "
                      f"launcher (mpirun -np {tasks} ... or horovodrun -np {tasks} ...), or "
                      f"use --strategy multi_worker under tfdist launch. Received: "
                      f"strategy=horovod, 1 Horovod rank, {why}")


def _one_of_several(cluster: ClusterInfo) -> tuple[int, str, str] | None:
    """(processes, why, the strategy to use) when a launcher made this one of several."""
    tf_config, mpi, slurm = cluster.tf_config, cluster.mpi, cluster.slurm
    if tf_config is not None and tf_config.task_type == "evaluator":
        return None  # A side-car evaluator runs beside the cluster, alone (TensorFlow's role).
    tasks = sum(len(addresses) for addresses in tf_config.cluster.values()) if tf_config else 1
    if tasks > 1:
        return tasks, f"TF_CONFIG makes this process one of {tasks} tasks", "multi_worker"
    if mpi is not None and mpi.size > 1:
        return mpi.size, f"{mpi.launcher} started {mpi.size} ranks", "horovod"
    if slurm is not None and slurm.num_tasks > 1:
        return slurm.num_tasks, f"Slurm started {slurm.num_tasks} tasks", "multi_worker"
    return None


def check_device(device: str, cluster: ClusterInfo, key: str) -> str:
    """Returns the device string if this machine has it; else raises ConfigError.

    Args:
        device: A TensorFlow device string such as '/gpu:1' or '/cpu:0'.
        cluster: Detected facts (the GPU count).
        key: The config key, for the message.
    """
    try:
        spec = tf.DeviceSpec.from_string(device)
    except ValueError:
        raise ConfigError(f"{key} must be a device such as '/cpu:0' or '/gpu:1'. "
                          f"Received: {key}={device!r}") from None
    kind = (spec.device_type or "").upper()
    if kind not in ("CPU", "GPU"):
        raise ConfigError(f"{key} must name a CPU or GPU device, such as '/gpu:0'. "
                          f"Received: {key}={device!r}")
    if kind == "GPU" and (spec.device_index or 0) >= len(cluster.gpus):
        raise ConfigError(f"{key} names {device}, but this machine has {len(cluster.gpus)} "
                          f"GPU(s); choose one that exists or leave it empty. "
                          f"Received: {key}={device!r}")
    return device
