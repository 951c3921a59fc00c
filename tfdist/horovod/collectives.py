"""The Horovod collectives a Keras 3 training job needs, shared by both front doors.

The `horovod` adapter (`tfdist.Runner`) and the drop-in `tfdist.horovod.keras`
reduce gradients, broadcast a model's state and average metrics with the same
code, here. Only `horovod.tensorflow`'s collectives are used, never its Keras 2
integration, which Keras 3 never calls (horovod/horovod#4290).

Example:

    hvd = import_horovod()
    hvd.init()
    allreduce = gradient_allreduce(hvd, op=hvd.Average)
    model.compile(GradientReducingOptimizer(keras.optimizers.SGD(0.1), allreduce), "mse")
    model.fit(x, y, callbacks=[BroadcastState(hvd), AverageMetrics(hvd)])
"""

from __future__ import annotations

import functools
import numbers
import os
import sys
from types import ModuleType
from typing import Any, Callable, Iterable, Sequence

import keras
import numpy as np
import tensorflow as tf

from tfdist import sharding
from tfdist.errors import ConfigError
from tfdist.horovod.ordering import in_step_order


def install_command() -> str:
    """The command that builds Horovod into this Python's environment: the script ships in
    the package, so it exists in a checkout and in an installed wheel alike."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "install_horovod.sh")
    return f"HOROVOD_PYTHON={sys.executable} bash {script}"


def import_horovod() -> ModuleType:
    """Returns `horovod.tensorflow`, or raises ConfigError saying how to install it."""
    try:
        import horovod.tensorflow as hvd
    except ImportError as error:
        raise ConfigError(f"Horovod built for this TensorFlow cannot be imported here; build "
                          f"it into this environment with `{install_command()}` (needs Open "
                          f"MPI: apt-get install openmpi-bin libopenmpi-dev; in a checkout, "
                          f"`make setup` runs it). "
                          f"Received: {type(error).__name__}: {error}") from None
    return hvd


def tf_variable(variable: Any) -> tf.Variable:
    """The `tf.Variable` under a Keras 3 variable (Horovod's ops take TensorFlow's own),
    past a zero_stage 2 or 3 weight's read (`tfdist.sharding.weights`)."""
    return sharding.stored_variable(variable)


# PyTorch DDP's default bucket: big enough that a bucket's fixed cost is small beside its
# transfer, small enough that the first is ready early in the backward pass.
BUCKET_BYTES = 25 * 2**20


def gradient_allreduce(hvd: ModuleType, *, op: Any, compression: Any = None,
                       sparse_as_dense: bool = False, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0, process_set: Any = None,
                       device_dense: str = "", device_sparse: str = "",
                       grouped: bool = True, bucket_bytes: int = BUCKET_BYTES,
                       ignore_name_scope: bool = False) -> Callable[[list[Any]], list[Any]]:
    """The allreduce of a list of gradients: one grouped call, or one per bucket.

    Every collective is issued in step order (`tfdist.horovod.ordering`): each starts
    once the one before it has finished, so the dense gradients go in a few grouped
    calls, not one chained call each (measured: ResNet-50's 214 gradients chained one
    by one made a step 20% slower than Horovod's own unordered loop).

    Args:
        hvd: The `horovod.tensorflow` module, initialised.
        op: `hvd.Average`, `hvd.Sum` or `hvd.Adasum`.
        compression: `hvd.Compression.none` (None) or `hvd.Compression.fp16`.
        sparse_as_dense: Reduce `tf.IndexedSlices` as dense tensors (always for
            Adasum: Horovod allgathers sparse gradients, which Adasum cannot combine).
        prescale_factor: Multiplies each gradient before the reduction.
        postscale_factor: Multiplies each result after it.
        process_set: The ranks that reduce together; None: all of them.
        device_dense: Where dense gradients are reduced ("": Horovod's default).
        device_sparse: Where sparse gradients are reduced.
        grouped: One `grouped_allreduce` of every dense gradient, which starts once all
            are computed; False: buckets of about `bucket_bytes`, the last layers'
            first, each started as soon as its gradients are computed (overlapping the
            rest of the backward pass). Adasum is always per gradient.
        bucket_bytes: The size of a bucket when not `grouped`.
        ignore_name_scope: Name each op by its gradient alone, without the scopes of the
            functions it runs in, which differ between ranks whose steps differ (each
            updating its own partition of sharded state).

    Returns:
        A function of a list of gradients (no None) that returns their reductions,
        in the same order. It runs inside the traced train step.
    """
    compression = compression or hvd.Compression.none
    process_set = process_set or hvd.global_process_set
    as_dense = sparse_as_dense or op == hvd.Adasum
    options = dict(op=op, compression=compression, process_set=process_set,
                   prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                   device_dense=device_dense, ignore_name_scope=ignore_name_scope)
    gather = dict(average=op == hvd.Average, process_set=process_set, device=device_sparse,
                  ignore_name_scope=ignore_name_scope)

    def allreduce(grads: list[Any]) -> list[Any]:
        if as_dense:
            grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
                     for g in grads]
        if op == hvd.Adasum:
            # One call per gradient: Horovod 0.28.1's grouped_allreduce fails for Adasum,
            # reading a loop variable (`tensor`) that its own loop never set
            # (UnboundLocalError, horovod/tensorflow/__init__.py).
            return [_gathered_rows(hvd, [g], **gather)[0] if isinstance(g, tf.IndexedSlices)
                    else in_step_order(functools.partial(hvd.allreduce, g, **options))
                    for g in grads]
        sparse = [i for i, g in enumerate(grads) if isinstance(g, tf.IndexedSlices)]
        dense = [i for i, g in enumerate(grads) if not isinstance(g, tf.IndexedSlices)]
        reduced = list(grads)
        for bucket in ([dense] if grouped else _buckets(grads, dense, bucket_bytes)):
            summed = in_step_order(functools.partial(
                hvd.grouped_allreduce, [grads[i] for i in bucket], **options))
            for i, value in zip(bucket, summed):
                reduced[i] = value
        if sparse:
            for i, value in zip(sparse, _gathered_rows(hvd, [grads[i] for i in sparse],
                                                       **gather)):
                reduced[i] = value
        return reduced

    return allreduce


def _buckets(grads: list[Any], indices: list[int], bucket_bytes: int) -> list[list[int]]:
    """`indices` in buckets of about `bucket_bytes`, the last gradients first.

    The backward pass computes the last layers' gradients first, so the first bucket is
    ready (and reduced) while the pass goes on, as in PyTorch DDP.
    """
    buckets: list[list[int]] = []
    size = bucket_bytes
    for i in reversed(indices):
        nbytes = grads[i].shape.num_elements() or 0
        nbytes *= grads[i].dtype.size
        if size + nbytes > bucket_bytes and (not buckets or buckets[-1]):
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += nbytes
    return buckets


def _gathered_rows(hvd: ModuleType, slices: list[tf.IndexedSlices], *, average: bool,
                   process_set: Any, device: str,
                   ignore_name_scope: bool) -> list[tf.IndexedSlices]:
    """Sparse gradients combined as Horovod combines them: every rank's rows, gathered
    (indices, then values, each in one grouped allgather issued in step order), and
    divided by the number of ranks for an average.

    Horovod's own `allreduce` of a `tf.IndexedSlices` issues its two allgathers with no
    order between them, and those of several gradients likewise (see `ordering`).
    """
    with tf.device(device):
        indices = in_step_order(functools.partial(
            hvd.grouped_allgather, [s.indices for s in slices], process_set=process_set,
            ignore_name_scope=ignore_name_scope))
        values = in_step_order(functools.partial(
            hvd.grouped_allgather, [s.values for s in slices], process_set=process_set,
            ignore_name_scope=ignore_name_scope))
        if average:
            # The size as an op, as Horovod has it: right after an elastic resize too.
            ranks = hvd.size_op(process_set_id=process_set.process_set_id)
            values = [v / tf.cast(ranks, v.dtype) for v in values]
    return [tf.IndexedSlices(v, i, dense_shape=s.dense_shape)
            for v, i, s in zip(values, indices, slices)]


@functools.cache
def allgather_accepts(dtype: tf.DType) -> bool:
    """Whether the installed Horovod's allgather op takes tensors of `dtype`."""
    from tensorflow.python.framework import op_def_registry

    import_horovod()  # Registers Horovod's ops.
    definition = op_def_registry.get("HorovodAllgather")
    allowed = next(attr.allowed_values.list.type for attr in definition.attr if attr.name == "T")
    return dtype.as_datatype_enum in allowed


class ShardCollectives(sharding.ShardCollectives):
    """The collectives of sharded training state (`tfdist.sharding`), with Horovod's ops.

    Each op has a fixed name, without the name scope: the ranks' train steps differ
    (each updates its own partition, so TensorFlow numbers their scopes differently), and
    Horovod matches the ranks' tensors by name.

    Args:
        hvd: The `horovod.tensorflow` module, initialised.
        average: The gradient all-reduce of stage 1 (the adapter's, with its options).
        before_update: Called once per update at stages 2 and 3, before the optimizer
            updates (the adapter's preemption vote rides there).

    Example:

        collectives = ShardCollectives(hvd, gradient_allreduce(hvd, op=hvd.Average))
        optimizer = sharding.sharded_optimizer(keras.optimizers.Adam(), collectives, stage=2)
    """

    def __init__(self, hvd: ModuleType, average: Callable[[list[Any]], list[Any]],
                 before_update: Callable[[], None] | None = None):
        self._hvd = hvd
        self._average = average
        self._before_update = before_update
        self.rank, self.size = hvd.rank(), hvd.size()

    def average(self, grads: list[Any]) -> list[Any]:
        return self._average(grads)

    def concatenate(self, flat: tf.Tensor) -> tf.Tensor:
        return in_step_order(functools.partial(
            self._hvd.allgather, flat, name="tfdist_zero_weights", ignore_name_scope=True))

    def sum(self, values: tf.Tensor) -> tf.Tensor:
        return in_step_order(functools.partial(
            self._hvd.allreduce, values, op=self._hvd.Sum, name="tfdist_zero_norms",
            ignore_name_scope=True))

    def gather(self, flat: tf.Tensor, name: str) -> tf.Tensor:
        if flat.dtype == tf.bfloat16 and not allgather_accepts(tf.bfloat16):
            # Horovod's allgather op lists no bfloat16 (horovod/horovod#4047, open): a
            # gather only moves bytes, so the tensor's 16-bit patterns go as uint16 and come
            # back bit for bit. Where the installed op accepts bfloat16 this does nothing.
            as_bits = self.gather(tf.bitcast(flat, tf.uint16), name)
            return tf.bitcast(as_bits, tf.bfloat16)
        return in_step_order(functools.partial(
            self._hvd.allgather, flat, name=name, ignore_name_scope=True))

    def reduce_scatter(self, flat: tf.Tensor, name: str) -> tf.Tensor:
        return in_step_order(functools.partial(
            self._hvd.reducescatter, flat, op=self._hvd.Average, name=name,
            ignore_name_scope=True))

    def broadcast(self, value: tf.Tensor, name: str) -> tf.Tensor:
        return self._hvd.broadcast(value, root_rank=0, name=name, ignore_name_scope=True)

    def before_update(self) -> None:
        if self._before_update is not None:
            self._before_update()


class BroadcastState(keras.callbacks.Callback):
    """Copies one rank's weights and optimizer state to every rank before each fit's first step.

    Replica-local variables (each rank's gradient accumulators), a sharded
    optimizer's partition (`tfdist.sharding`: each rank's own) and the variables in
    `local_variables` are left as they are.

    Before the first step, not at its end as Horovod's Keras 2 callback did, so the
    first gradients are computed on the same weights everywhere; and at the first
    batch rather than at `on_train_begin`, so that state restored by callbacks
    such as `BackupAndRestore` (which restore in `on_train_begin`) is what spreads.

    Args:
        hvd: The `horovod.tensorflow` module, initialised.
        root_rank: The rank whose state every rank takes.
        local_variables: Variables each rank keeps as they are.

    Example:

        model.fit(x, y, callbacks=[BroadcastState(hvd)])
    """

    def __init__(self, hvd: ModuleType, root_rank: int = 0,
                 local_variables: Iterable[Any] = ()):
        super().__init__()
        self._hvd = hvd
        self.root_rank = root_rank
        self._local = {id(tf_variable(variable)) for variable in local_variables}
        self._pending = False

    def register_local_var(self, variable: Any) -> None:
        """Leaves `variable` out of the broadcast: each rank keeps its own value."""
        self._local.add(id(tf_variable(variable)))

    def on_train_begin(self, logs: Any = None) -> None:
        self._pending = True

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        if not self._pending:
            return
        self._pending = False
        optimizer = self.model.optimizer
        if optimizer is not None and not optimizer.built:
            optimizer.build(self.model.trainable_variables)
        state = list(self.model.weights) + (list(optimizer.variables) if optimizer else [])
        sharded = sharding.find_sharded(optimizer)
        local = self._local | {id(tf_variable(variable)) for variable in (
            sharded.sharded_variables if sharded is not None else ())} | {
            id(tf_variable(variable)) for variable in state if sharding.is_sharded(variable)}
        # Replica-local state (gradient accumulators) is each rank's own by design: a
        # fit that starts in the middle of an accumulation cycle must keep it.
        shared = [variable for variable in map(tf_variable, state)
                  if variable.synchronization != tf.VariableSynchronization.ON_READ
                  and id(variable) not in local]
        self._hvd.broadcast_variables(shared, root_rank=self.root_rank)


class AverageMetrics(keras.callbacks.Callback):
    """Replaces each logged metric by its mean across ranks, at epoch and evaluation ends.

    Every rank's History (and what the chief prints) is then the same. Each rank's
    value is the mean over its own slices, so the result is the mean over all
    examples when every rank sees as many (as `runner.dataset` arranges for
    training). Place callbacks that read these logs (History, checkpointing on the
    best value) after it; Keras adds History last by itself. (`model.evaluate`
    returns its own copy of the logs, which callbacks cannot change: evaluate on
    `runner.dataset(..., drop_remainder=False)`, which is whole on every rank.)

    Args:
        hvd: The `horovod.tensorflow` module, initialised.

    Example:

        model.fit(x, y, callbacks=[AverageMetrics(hvd)])
    """

    def __init__(self, hvd: ModuleType):
        super().__init__()
        self._hvd = hvd

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self._average(logs)

    def on_test_end(self, logs: Any = None) -> None:
        self._average(logs)

    def _average(self, logs: dict[str, Any] | None) -> None:
        if not logs:
            return
        keys = sorted(key for key, value in logs.items() if _is_scalar(value))
        if not keys:
            return
        local = tf.constant([float(logs[key]) for key in keys], dtype=tf.float64)
        averaged = self._hvd.allreduce(local, op=self._hvd.Average, name="tfdist_metrics")
        logs.update(zip(keys, averaged.numpy().tolist()))


def _is_scalar(value: Any) -> bool:
    return isinstance(value, numbers.Real) or (
        isinstance(value, (np.ndarray, np.generic, tf.Tensor)) and np.size(value) == 1)


def rank_local_sums(variables: Sequence[Any]) -> list[tf.Variable]:
    """The rank-local variables that add up across ranks: "on read" sums (gradient
    accumulators, metric totals and counts)."""
    return [variable for variable in map(tf_variable, variables)
            if variable.synchronization == tf.VariableSynchronization.ON_READ
            and variable.aggregation == tf.VariableAggregation.SUM]
