"""`horovod`: data parallelism across processes started by `mpirun` or `horovodrun`.

One process (rank) per device. Each rank trains on its slice of every global
batch under a one-device strategy, and Horovod's fused allreduce (MPI, Gloo or
NCCL) averages the gradients. Keras 3's own train step stays in charge; only
`horovod.tensorflow`'s collectives are used, not its Keras 2 integration, which
Keras 3 never calls (horovod/horovod#4290):

- `runner.optimizer` reduces the gradients across ranks before they are applied
  (`tfdist.optimizers`), with the config's op, compression and learning-rate
  scaling; under mixed_float16 every rank skips the same non-finite steps.
- `runner.callbacks` copies rank 0's weights and optimizer state to every rank
  before the first step of each `fit` (so after a resume too), and averages the
  logged metrics across ranks, so every rank's History is the same.
- `runner.dataset` gives each rank its slice of each global batch.

Example:

    # mpirun -np 2 tfdist train --strategy horovod
    runner = tfdist.Runner(tfdist.load_config(overrides={"strategy": "horovod"}))
    runner.num_replicas, runner.is_chief   # (2, True) on rank 0
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from types import ModuleType
from typing import Any, Callable, Iterator, Sequence

import keras
import tensorflow as tf

from tfdist import sharding
from tfdist.adapters.base import (Adapter, DatasetSource, batched, call_dataset_function,
                                  check_global_batch_size, check_horovod_world)
from tfdist.cluster import ClusterInfo, set_default_environment
from tfdist.config import Compression, Config, Reduction
from tfdist.errors import ConfigError
from tfdist.horovod import collectives, elastic
from tfdist.horovod.collectives import AverageMetrics, BroadcastState, ShardCollectives
from tfdist.horovod.ordering import in_step_order
from tfdist.optimizers import GradientReducingOptimizer
from tfdist.patches import HOROVOD
from tfdist.resume.preemption import StopAgreement, VotedStop
from tfdist.schedules import ScaledWarmup
from tfdist.resume.shuffling import EpochShuffle


_said_one_rank = False  # The lone-rank notice is said once per process.


def import_horovod() -> ModuleType:
    """Returns `horovod.tensorflow`, or raises ConfigError saying how to install it."""
    try:
        return collectives.import_horovod()
    except ConfigError as error:
        raise ConfigError(f"strategy horovod needs Horovod: {error}") from None


# Horovod's background thread starts the collectives submitted since its last cycle once
# per cycle (1 ms by default). At zero_stage 2 and 3 each collective is issued once the one
# before it has finished (tfdist.horovod.ordering), a few per layer and step, so each
# waits up to a cycle: on 2 ranks, a 40-layer MLP's stage-3 step took 2.08x stage 0's at
# 1 ms and 1.37x at 0.1 ms (benchmarks/zero.py).
ZERO_CYCLE_TIME_MS = 0.1


class HorovodAdapter(Adapter):
    """One rank per device; gradients averaged with Horovod's collectives."""

    zero_refusal = None
    model_parallel_refusal = None

    patches = HOROVOD

    def __init__(self, config: Config, cluster: ClusterInfo):
        super().__init__(config, cluster)
        self.hvd = import_horovod()
        cycle_time_ms = config.horovod.cycle_time_ms
        if cycle_time_ms is None and config.zero_stage >= 2:
            cycle_time_ms = ZERO_CYCLE_TIME_MS
        if cycle_time_ms is not None:
            # Read when Horovod starts; a value the user exported wins.
            set_default_environment({"HOROVOD_CYCLE_TIME": f"{cycle_time_ms:g}"})
        timeout = config.horovod.timeout_seconds
        if timeout:
            # Horovod reads these when it starts: a rank that has not joined a collective
            # the others wait in for `timeout` seconds shuts Horovod down, and every
            # rank's collective fails, instead of all waiting for ever. Values the user
            # exported (mpirun -x, horovodrun's flags) win.
            set_default_environment({
                "HOROVOD_STALL_CHECK_TIME_SECONDS": str(max(1, int(timeout) // 2)),
                "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": str(max(2, int(timeout)))})
        self.hvd.init()
        global _said_one_rank
        if check_horovod_world(self.hvd.size(), cluster) and not _said_one_rank:
            _said_one_rank = True
            # Open MPI refuses root unless asked: the line says how, where it applies.
            root = " --allow-run-as-root" if os.geteuid() == 0 else ""
            print(f"tfdist: strategy horovod runs as 1 rank (started without mpirun or "
                  f"horovodrun); start N ranks with mpirun{root} -np N or horovodrun -np N to "
                  f"train on N", file=sys.stderr, flush=True)
        self._scaled_rates: list[ScaledWarmup] = []  # Follow the size after an elastic reset.
        self._voting = False  # Whether traced steps carry the preemption vote.
        self._traced_without_vote = False
        size = self.hvd.size()
        if config.zero_stage == 3 and config.model_parallel.devices > 1:
            raise ConfigError(f"zero_stage 3 stores each weight as 1/N per rank, and "
                              f"model_parallel places whole layers on devices; the two do not "
                              f"compose yet: use zero_stage 2 with model_parallel, or "
                              f"model_parallel.devices 1. Received: zero_stage=3, "
                              f"model_parallel.devices={config.model_parallel.devices}")
        if config.horovod.op is Reduction.ADASUM and size & (size - 1):
            raise ConfigError(f"horovod.op adasum needs a power-of-2 number of ranks (Horovod "
                              f"supports no other); start 2, 4, 8... ranks or use average. "
                              f"Received: {size} ranks")

    def create_strategy(self) -> tf.distribute.Strategy:
        gpus = tf.config.list_physical_devices("GPU")
        per_rank = self.config.model_parallel.devices
        if gpus:
            self._pin_gpus(gpus, per_rank)
        if per_rank > 1:
            # Each rank one copy of the model over its devices (2-D parallelism). The
            # default strategy leaves placement to the layers: OneDeviceStrategy would put
            # every variable on its one device.
            return tf.distribute.get_strategy()
        return tf.distribute.OneDeviceStrategy("/gpu:0" if gpus else "/cpu:0")

    def _pin_gpus(self, gpus: Sequence[Any], per_rank: int) -> None:
        """Makes rank r see only its GPUs: r*K ... r*K+K-1 of its machine's."""
        local_rank, local_size = self.hvd.local_rank(), self.hvd.local_size()
        if local_size * per_rank > len(gpus):
            each = "GPU" if per_rank == 1 else f"{per_rank} GPUs (model_parallel.devices)"
            # Reached only with GPUs (more ranks on a machine than it has).
            raise ConfigError(f"strategy horovod runs one rank per {each}, but this machine "
                              f"has {len(gpus)} GPU(s) and {local_size} ranks; start at most "
                              f"{len(gpus) // per_rank} ranks per machine (mpirun -np / -H "
                              f"host:N). Received: {local_size} local ranks")
        try:
            # Each rank sees only its own GPUs, so it neither allocates memory on the
            # others nor places ops there.
            tf.config.set_visible_devices(
                gpus[local_rank * per_rank:(local_rank + 1) * per_rank], "GPU")
        except RuntimeError:
            # Reached only with GPUs (TensorFlow running before the Runner).
            raise ConfigError("strategy horovod pins each rank to its GPU before TensorFlow "
                              "starts; create the Runner first in your program. "
                              "Received: TensorFlow already running") from None

    @property
    def num_replicas(self) -> int:
        """The ranks: each trains one replica."""
        return self.hvd.size()

    @property
    def is_chief(self) -> bool:
        """Rank 0."""
        return self.hvd.rank() == 0

    def intra_op_threads(self) -> int:
        """This rank's share of the machine's cores, less one for Horovod's own threads.

        Every rank on a machine otherwise sizes its pool to all the cores, and the
        oversubscribed pools starve Horovod's background thread, which slows every
        collective (horovod/horovod#2804). A share of 1 or 2 cores is kept whole.
        """
        share = max(1, self.cluster.cpu_cores // max(1, self.hvd.local_size()))
        return share - 1 if share > 2 else share

    def distribute_dataset(self, source: DatasetSource, global_batch_size: int, *,
                           drop_remainder: bool = True,
                           shuffle: EpochShuffle | None = None) -> Any:
        """Each rank's slice of every global batch; whole batches for evaluation.

        Args:
            source: An unbatched `tf.data.Dataset` in the same order on every rank
                (shuffle with a seed). Each rank batches it globally and keeps slice
                `rank` of each batch, so together the ranks take one_device's batch
                at every step. Or a function of `tf.distribute.InputContext` that
                shards by `input_pipeline_id` (the rank) and gives every rank the
                same number of batches; it is batched per rank.
            global_batch_size: Examples per step across all ranks.
            drop_remainder: True (training): drop a final partial global batch.
                False (evaluation): every rank gets every global batch whole, the
                partial one included, so `model.evaluate` returns the figures of
                the whole dataset on every rank (the work is repeated, not split).
            shuffle: Shuffles each epoch in the order of (seed, epoch), the same
                order on every rank, before each takes its slices.
        """
        size, rank = self.hvd.size(), self.hvd.rank()
        check_global_batch_size(global_batch_size, size)
        if not isinstance(source, tf.data.Dataset):
            context = tf.distribute.InputContext(num_input_pipelines=size,
                                                 input_pipeline_id=rank,
                                                 num_replicas_in_sync=size)
            return batched(self.shuffled(call_dataset_function(source, context), shuffle),
                           global_batch_size // size, drop_remainder)
        dataset = self.shuffled(source, shuffle).batch(global_batch_size,
                                                       drop_remainder=drop_remainder)
        if drop_remainder:
            dataset = dataset.map(functools.partial(_rank_slice, rank=rank, size=size),
                                  num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        return dataset.prefetch(tf.data.AUTOTUNE)

    def run_elastic(self, train: Callable[[Any], Any]) -> Any:
        """Runs `train(state)` under Horovod elastic (`tfdist.horovod.elastic`): after a
        rank is lost, the others restore the last commit to `state`, Horovod restarts
        with the ranks left, this adapter follows the new size, and `train` runs again."""
        state = elastic.elastic_state_cls()(self.hvd)
        return elastic.run(self.hvd, state, lambda: train(state), on_reset=lambda: (
            state.model is not None and self.on_membership_change(state.model)))

    def on_membership_change(self, model: Any) -> None:
        """After Horovod elastic restarted with other ranks: follow the new number of ranks.

        The learning-rate multiplier of `horovod.scale_learning_rate` becomes the new
        size, and the model's traced functions, which hold the old size as a
        constant, are traced again at their next call.

        Args:
            model: The model being trained.
        """
        for schedule in self._scaled_rates:
            schedule.multiplier = float(self.hvd.size())
        model.train_function = model.test_function = model.predict_function = None

    def wrap_optimizer(self, optimizer: Any) -> Any:
        """Averages (or sums) gradients across ranks before the optimizer applies them.

        With `horovod.scale_learning_rate`, the learning rate (a float or a schedule)
        becomes `ScaledWarmup(rate, ranks, horovod.warmup_steps)`.
        """
        options = self.config.horovod
        if options.scale_learning_rate:
            config = optimizer.get_config()
            learning_rate = config["learning_rate"]
            if isinstance(learning_rate, dict):
                learning_rate = keras.optimizers.schedules.deserialize(learning_rate)
            schedule = ScaledWarmup(learning_rate, multiplier=self.hvd.size(),
                                    warmup_steps=options.warmup_steps)
            # A new optimizer built with the schedule, not `optimizer.learning_rate = ...`:
            # that setter untracks the rate's variable by deleting it from the optimizer's
            # tracked list, and tf.train.Checkpoint then refuses to save the optimizer
            # ("A list element was replaced ... tracking is exclusively for append-only
            # data structures").
            optimizer = type(optimizer).from_config({**config, "learning_rate": schedule})
            self._scaled_rates.append(schedule)
        if self.config.zero_stage:
            # With accumulation, stage 2 reduce-scatters once per cycle, after the backward
            # passes: its accumulators stay whole, rank-local sums a checkpoint can hold
            # (sliced ones would need the shard files; stage 3 refuses that pair).
            return sharding.sharded_optimizer(
                optimizer, self._shard_collectives, self.config.zero_stage,
                reduce_in_backward=self.config.accumulation_steps == 1,
                gathering=self._gathering)
        return GradientReducingOptimizer(optimizer, reduce_fn=self.gradient_reduce_fn())

    @property
    def _gathering(self) -> sharding.Gathering:
        """How zero_stage 3 gathers the weights: the config's `zero:` section."""
        zero = self.config.zero
        return sharding.Gathering(regather=zero.reshard_after_forward, prefetch=zero.prefetch,
                                  bucket_bytes=int(zero.bucket_mb * (1 << 20)),
                                  unit=tuple(zero.unit))

    @functools.cached_property
    def _shard_collectives(self) -> ShardCollectives:
        return ShardCollectives(self.hvd, self.gradient_reduce_fn(), before_update=self._ride_vote)

    def creation_scope(self) -> contextlib.AbstractContextManager[None]:
        """At zero_stage 3, trainable variables are created as this rank's slice only
        (`tfdist.sharding.weights`)."""
        if self.config.zero_stage == 3:
            return sharding.sharded_creation(self._shard_collectives, self._gathering)
        return contextlib.nullcontext()

    def gradient_reduce_fn(self) -> Callable[[list[Any]], list[Any]]:
        """The config's reduction: one grouped allreduce, or one per gradient (`grouped`)."""
        hvd, options = self.hvd, self.config.horovod
        op = {Reduction.AVERAGE: hvd.Average, Reduction.SUM: hvd.Sum,
              Reduction.ADASUM: hvd.Adasum}[options.op]
        compression = {Compression.NONE: hvd.Compression.none,
                       Compression.FP16: hvd.Compression.fp16}[options.compression]
        # Under zero_stage the ranks' steps differ, and so do the scopes TensorFlow names
        # their ops in: Horovod must match the ranks' gradients by their own names.
        reduce = collectives.gradient_allreduce(hvd, op=op, compression=compression,
                                                sparse_as_dense=options.sparse_as_dense,
                                                grouped=options.grouped,
                                                ignore_name_scope=bool(self.config.zero_stage))

        def allreduce(grads: list[Any]) -> list[Any]:
            self._ride_vote()
            return reduce(grads)

        return allreduce

    def _ride_vote(self) -> None:
        """Where the gradients are reduced: this step's preemption vote, if there is one.

        Read when the step is traced. With preemption handling (see `stop_agreement`),
        the vote rides along: Horovod negotiates it in the same cycle as the gradients,
        so it adds no round trip, only its own small cost.
        """
        if self._voting:
            stop_flag, stop_votes = self._stop_vote
            stop_votes.assign(in_step_order(lambda: self.hvd.allreduce(
                stop_flag.read_value(), op=self.hvd.Sum, name="tfdist_stop_vote",
                ignore_name_scope=True)))
        else:
            self._traced_without_vote = True

    @functools.cached_property
    def _stop_vote(self) -> tuple[tf.Variable, tf.Variable]:
        """This rank's preemption flag, and the sum of all ranks' flags at the last update."""
        from tensorflow.python.ops import resource_variable_ops

        with tf.init_scope():
            return tuple(resource_variable_ops.ResourceVariable(
                0.0, trainable=False, name=name) for name in ("tfdist_stop_flag",
                                                              "tfdist_stop_votes"))

    def finite_reduce_fn(self) -> Callable[[Any], Any]:
        """Finite only if finite on every rank: all ranks skip the same steps."""
        hvd = self.hvd

        def all_ranks_finite(finite: Any) -> Any:
            votes = in_step_order(lambda: hvd.allreduce(
                tf.cast(finite, tf.int32), op=hvd.Min, name="tfdist_all_ranks_finite",
                ignore_name_scope=True))
            return tf.cast(votes, tf.bool)

        return all_ranks_finite

    def callbacks(self) -> list[Any]:
        return [BroadcastState(self.hvd), AverageMetrics(self.hvd)]

    # --- checkpoints and preemption ------------------------------------------------------

    @property
    def num_processes(self) -> int:
        return self.hvd.size()

    def process_sum(self, values: Sequence[float]) -> list[float]:
        local = tf.constant([float(value) for value in values], tf.float64)
        summed = self.hvd.allreduce(local, op=self.hvd.Sum, name="tfdist_process_sum")
        return summed.numpy().tolist()

    def barrier(self, name: str) -> None:
        # horovod.tensorflow has no barrier; an allreduce every rank must join is one.
        self.hvd.allreduce(tf.constant(0.0), op=self.hvd.Sum, name=f"tfdist_barrier_{name}")

    def stop_agreement(self, run_key: str) -> StopAgreement:
        """The vote that rides with each update's gradient allreduce: the stop comes at
        the first step boundary after an update (under accumulation, the end of a
        cycle) that carried a raised flag.

        Steps traced before there was a vote to carry (a fit without checkpoints) are
        traced again (`VotedStop.needs_retrace`).
        """
        self._voting = True
        return VotedStop(*self._stop_vote, needs_retrace=self._traced_without_vote)

    @contextlib.contextmanager
    def prepare_checkpoint(self, variables: Sequence[Any]) -> Iterator[None]:
        """During a save, each rank-local running sum holds its sum over the ranks.

        Gradient accumulators and metric totals and counts are each rank's own (the
        variables are rank-local, "on read" sums); rank 0 writes the checkpoint, which
        then holds the sums over the ranks, as the tf.distribute strategies'
        checkpoints do. `after_restore` gives each rank an equal share: an update
        depends only on the accumulators' sum, and the averaged metrics only on the
        metrics' sums (every rank counts as many examples).
        """
        sums = collectives.rank_local_sums(variables)
        if not sums:
            yield
            return
        local = [variable.read_value() for variable in sums]
        summed = self.hvd.grouped_allreduce(local, op=self.hvd.Sum,
                                            name="tfdist_checkpoint_sums")
        for variable, value in zip(sums, summed):
            variable.assign(value)
        try:
            yield
        finally:
            for variable, value in zip(sums, local):
                variable.assign(value)

    def after_restore(self, variables: Sequence[Any]) -> None:
        size = self.hvd.size()
        for variable in collectives.rank_local_sums(variables):
            variable.assign(variable.read_value() / tf.cast(size, variable.dtype))


def _rank_slice(*element: Any, rank: int, size: int) -> Any:
    """Rows [n*rank/size, n*(rank+1)/size) of every tensor in a (full) batch of n."""
    element = element[0] if len(element) == 1 else element
    rows = tf.shape(tf.nest.flatten(element)[0])[0]
    start, stop = rows * rank // size, rows * (rank + 1) // size
    return tf.nest.map_structure(lambda tensor: tensor[start:stop], element)
