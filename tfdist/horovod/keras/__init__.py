"""`horovod.tensorflow.keras` (and `horovod.keras`) for Keras 3: change one import line.

    import tfdist.horovod.keras as hvd     # was: import horovod.tensorflow.keras as hvd

Every public name of Horovod 0.28.1's two Keras modules is here with its
signature. On Keras 3 Horovod's own `DistributedOptimizer` silently does not
reduce gradients (it overrides `get_gradients`/`_compute_gradients`, which Keras 3
never calls): each rank trains on its own gradients and ends with its own weights.
Here:

- `DistributedOptimizer(opt, ...)` returns an optimizer of `opt`'s class (a
  subclass with the same name, so a saved model loads in plain Keras) whose
  `apply`, the method Keras 3's train step calls, reduces the gradients with one
  grouped allreduce (`tfdist.horovod.collectives`, the code the `horovod` adapter
  uses) before the update; `backward_passes_per_step` accumulates with
  `tfdist.accumulation.GradientAccumulator`, one allreduce per update.
- `callbacks` and `elastic` hold Horovod's callbacks and elastic state for Keras 3.
- `init()` initialises Horovod and applies the fixes Horovod's own code and scripts
  need on Keras 3 (`tfdist.patches.HOROVOD_KERAS`: among them, `compile` accepts
  `experimental_run_tf_function`, and a model without an `Input` is built before the
  broadcast); importing this module changes nothing.

What cannot carry over to Keras 3 is refused with one line that says why
(`tfdist.ConfigError`, a ValueError).

Example (every rank, under `mpirun -np 2` or `horovodrun -np 2`):

    hvd.init()
    model.compile(hvd.DistributedOptimizer(keras.optimizers.Adam(1e-3 * hvd.size())),
                  loss="sparse_categorical_crossentropy")
    model.fit(dataset, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                                  hvd.callbacks.MetricAverageCallback()])
"""

from __future__ import annotations

import warnings
from typing import Any, Sequence

import keras
import tensorflow as tf
from horovod.common.util import is_version_greater_equal_than  # noqa: F401 (Horovod's name)
from horovod.tensorflow import (Adasum, Average, Sum, ccl_built, cross_rank,  # noqa: F401
                                cross_size, cuda_built, ddl_built, gloo_built, gloo_enabled,
                                is_initialized, local_rank, local_size, mpi_built, mpi_enabled,
                                mpi_threads_supported, nccl_built, rank, rocm_built, shutdown,
                                size, start_timeline, stop_timeline)
from horovod.tensorflow.compression import Compression
# Horovod's own: they convert a value to a tensor and call horovod.tensorflow, which works on
# Keras 3 as it is.
from horovod.tensorflow.keras import allgather, allreduce, broadcast, reducescatter  # noqa: F401
from horovod.tensorflow.mpi_ops import (ProcessSet, add_process_set,  # noqa: F401
                                        global_process_set, remove_process_set)

import horovod.tensorflow as _hvd
from tfdist import patches as _patches
from tfdist.accumulation import GradientAccumulator as _GradientAccumulator
from tfdist.errors import ConfigError
from tfdist.horovod import collectives as _collectives
from tfdist.horovod.keras import callbacks, elastic  # noqa: F401
from tfdist.horovod.keras.layers import SyncBatchNormalization  # noqa: F401
from tfdist.optimizers import named_as as _named_as


def init(*args: Any, **kwargs: Any) -> None:
    """Initialises Horovod (`horovod.tensorflow.init`'s arguments), then applies the fixes
    Horovod's code and scripts need on Keras 3 (`tfdist.patches.HOROVOD_KERAS`; `tfdist
    env` lists them).

    Example:

        hvd.init()
        hvd.rank(), hvd.size()
    """
    _hvd.init(*args, **kwargs)
    _patches.apply(_patches.HOROVOD_KERAS)


def DistributedOptimizer(optimizer: keras.optimizers.Optimizer, name: str | None = None,
                         device_dense: str = "", device_sparse: str = "",
                         compression: Any = Compression.none, sparse_as_dense: bool = False,
                         gradient_predivide_factor: float = 1.0, op: Any = Average,
                         backward_passes_per_step: int = 1,
                         average_aggregated_gradients: bool = False, num_groups: int = 0,
                         groups: Any = None, process_set: Any = global_process_set,
                         scale_local_gradients: bool = True) -> keras.optimizers.Optimizer:
    """`optimizer`, with its gradients reduced across ranks before every update.

    Args:
        optimizer: A Keras 3 optimizer (its state is not carried over: build it fresh,
            as with Horovod). Under a `mixed_float16` policy it is first put in a
            `keras.optimizers.LossScaleOptimizer`, so that every rank checks the same
            reduced gradients for infinities and skips the same steps.
        name: The name scope of the allreduce ops (default "Distributed<Class>").
        device_dense: Device for dense allreduces ("" : Horovod's default).
        device_sparse: Device for sparse allreduces.
        compression: `Compression.none` or `Compression.fp16`.
        sparse_as_dense: Reduce sparse gradients (embeddings) as dense tensors.
        gradient_predivide_factor: With `Average`: divide by this before the sum and by
            size / factor after it.
        op: `Average`, `Sum` or `Adasum` (Adasum needs a power-of-2 number of ranks).
        backward_passes_per_step: Micro-batches whose gradients are accumulated on each
            rank and reduced once, with one allreduce, per update.
        average_aggregated_gradients: Apply the mean of the accumulated gradients (a
            batch `backward_passes_per_step` times larger) instead of their sum.
        num_groups: Deprecated by Horovod; use `groups`.
        groups: None (one grouped allreduce), an integer n (n of them, the gradients
            split evenly), or lists of variables reduced together (the others alone).
        process_set: The ranks that reduce together.
        scale_local_gradients: Divide the gradients of variables registered with
            `register_local_var` by the number of ranks, as Horovod does.

    Returns:
        An optimizer of `optimizer`'s class and config, which also has
        `register_local_var(variable)`.

    Example:

        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size()),
                                       backward_passes_per_step=4,
                                       average_aggregated_gradients=True)
    """
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise ConfigError(f"DistributedOptimizer wraps a Keras 3 optimizer (keras.optimizers."
                          f"*); build one with keras.optimizers. Received: "
                          f"{type(optimizer).__module__}.{type(optimizer).__name__}")
    if op not in (Average, Sum, Adasum):
        raise ConfigError(f"DistributedOptimizer reduces with op Average, Sum or Adasum; "
                          f"pass one of them. Received: op={op!r}")
    if op == Adasum and _hvd.is_initialized() and size() & (size() - 1):
        raise ConfigError(f"op Adasum needs a power-of-2 number of ranks (Horovod supports no "
                          f"other); start 2, 4, 8... ranks or use Average. "
                          f"Received: {size()} ranks")
    if (not isinstance(backward_passes_per_step, int)
            or isinstance(backward_passes_per_step, bool) or backward_passes_per_step < 1):
        raise ConfigError(f"backward_passes_per_step must be an integer >= 1. Received: "
                          f"backward_passes_per_step={backward_passes_per_step!r}")
    if num_groups:
        warnings.warn("Parameter `num_groups` has been replaced by `groups`.",
                      DeprecationWarning, stacklevel=2)
        groups = num_groups if groups is None else groups
    if groups is not None and not (isinstance(groups, list)
                                   or (isinstance(groups, int) and groups > 0)):
        raise ConfigError(f"groups must be a positive integer or a list of lists of "
                          f"variables. Received: groups={groups!r}")
    if (keras.config.dtype_policy().name == "mixed_float16"
            and not isinstance(optimizer, keras.optimizers.LossScaleOptimizer)):
        # Keras's compile would put the loss scaling outside, where each rank would
        # test its own gradients before the reduction: ranks that disagree about an inf
        # would not all enter the allreduce, and wait for ever.
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    distributed = _distributed_class(type(optimizer)).from_config(optimizer.get_config())
    distributed._hvd_reduction = _Reduction(
        name=name or f"Distributed{type(optimizer).__name__}", device_dense=device_dense,
        device_sparse=device_sparse, compression=compression, sparse_as_dense=sparse_as_dense,
        gradient_predivide_factor=gradient_predivide_factor, op=op, groups=groups,
        process_set=process_set, scale_local_gradients=scale_local_gradients,
        backward_passes_per_step=backward_passes_per_step,
        average_aggregated_gradients=average_aggregated_gradients)
    return distributed


def PartialDistributedOptimizer(optimizer: keras.optimizers.Optimizer, name: str | None = None,
                                device_dense: str = "", device_sparse: str = "",
                                compression: Any = Compression.none,
                                sparse_as_dense: bool = False,
                                gradient_predivide_factor: float = 1.0, op: Any = Average,
                                groups: Any = None, process_set: Any = global_process_set,
                                local_layers: Any = None,
                                scale_local_gradients: bool = True) -> Any:
    """`DistributedOptimizer` whose `local_layers` keep their own (unreduced) gradients.

    Args:
        local_layers: A Keras layer or a list of them, trained on each rank's own
            gradients (divided by the number of ranks with `scale_local_gradients`).
        The others: as `DistributedOptimizer`.

    Example:

        opt = hvd.PartialDistributedOptimizer(keras.optimizers.Adam(),
                                              local_layers=[model.layers[0]])
    """
    if local_layers is None:
        local_layers = []
    elif isinstance(local_layers, keras.layers.Layer):
        local_layers = [local_layers]
    elif not all(isinstance(layer, keras.layers.Layer) for layer in local_layers):
        raise ConfigError(f"local_layers must be Keras layers. Received: {local_layers!r}")
    distributed = DistributedOptimizer(
        optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse,
        compression=compression, sparse_as_dense=sparse_as_dense,
        gradient_predivide_factor=gradient_predivide_factor, op=op, groups=groups,
        process_set=process_set, scale_local_gradients=scale_local_gradients)
    for layer in local_layers:
        for variable in layer.trainable_weights:
            distributed.register_local_var(variable)
    return distributed


class _Reduction:
    """How a `DistributedOptimizer` reduces: its allreduce, groups, local variables and
    accumulation (`DistributedOptimizer`'s arguments). Not a Keras object, so not part
    of the optimizer's saved state."""

    def __init__(self, *, name: str, device_dense: str = "", device_sparse: str = "",
                 compression: Any = Compression.none, sparse_as_dense: bool = False,
                 gradient_predivide_factor: float = 1.0, op: Any = Average, groups: Any = None,
                 process_set: Any = global_process_set, scale_local_gradients: bool = True,
                 backward_passes_per_step: int = 1, average_aggregated_gradients: bool = False):
        if op == Average and gradient_predivide_factor != 1.0:
            # Horovod splits the average: 1/f before the sum, f/size after it.
            scaling = dict(prescale_factor=1.0 / gradient_predivide_factor,
                           postscale_factor=gradient_predivide_factor)
        else:
            scaling = {}
        self.allreduce = _collectives.gradient_allreduce(
            _hvd, op=op, compression=compression, sparse_as_dense=sparse_as_dense,
            process_set=process_set, device_dense=device_dense, device_sparse=device_sparse,
            **scaling)
        self.name = name
        self.groups = groups
        self.process_set = process_set
        self.scale_local_gradients = scale_local_gradients
        self.accumulator = (_GradientAccumulator(backward_passes_per_step,
                                                 average=average_aggregated_gradients)
                            if backward_passes_per_step > 1 else None)
        self.local: set[int] = set()
        # The gradients `_compute_gradients`/`get_gradients` last returned, reduced
        # already: `apply` applies exactly these objects without reducing them again.
        self.reduced_ahead: list[Any] = []

    def reduce(self, grads: Sequence[Any], variables: Sequence[Any]) -> list[Any]:
        """`grads` with each shared gradient reduced across ranks, and each local one
        divided by the number of ranks (with `scale_local_gradients`)."""
        grads = list(grads)
        keys = [id(_collectives.tf_variable(variable)) for variable in variables]
        present = [index for index, grad in enumerate(grads) if grad is not None]
        local = [index for index in present if keys[index] in self.local]
        shared = [index for index in present if keys[index] not in self.local]
        with tf.name_scope(self.name + "_Allreduce"):
            for group in self._split(shared, keys):
                for index, grad in zip(group, self.allreduce([grads[i] for i in group])):
                    grads[index] = grad
        if self.scale_local_gradients and local:
            ranks = tf.cast(self.process_set.size(), tf.float32)
            for index in local:
                grads[index] = _divided(grads[index], ranks)
        return grads

    def _split(self, indices: list[int], keys: list[int]) -> list[list[int]]:
        """The gradients (by index) that each grouped allreduce reduces together."""
        if not indices:
            return []
        if self.groups is None:
            return [indices]
        if isinstance(self.groups, int):
            count = min(self.groups, len(indices))
            bounds = [len(indices) * part // count for part in range(count + 1)]
            return [indices[start:stop] for start, stop in zip(bounds, bounds[1:])]
        position = {key: index for index, key in enumerate(keys) if index in indices}
        split, taken = [], set()
        for group in self.groups:
            members = [position[key] for key in
                       (id(_collectives.tf_variable(variable)) for variable in group)
                       if key in position and position[key] not in taken]
            taken.update(members)
            if members:
                split.append(sorted(members))
        return split + [[index] for index in indices if index not in taken]


def _divided(grad: Any, divisor: Any) -> Any:
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values / tf.cast(divisor, grad.values.dtype),
                                grad.indices, grad.dense_shape)
    return grad / tf.cast(divisor, grad.dtype)


class _DistributedMixin:
    """What `DistributedOptimizer` adds to the user's optimizer class."""

    _hvd_reduction: _Reduction

    def register_local_var(self, var: Any) -> None:
        """Registers a variable as rank-local: its gradient is not reduced across ranks."""
        self._hvd_reduction.local.add(id(_collectives.tf_variable(var)))

    def build(self, var_list: Sequence[Any]) -> None:
        super().build(var_list)
        accumulator = self._hvd_reduction.accumulator
        if accumulator is not None and accumulator.micro_batches is None:
            # Not tracked by the optimizer: a saved model holds exactly the optimizer
            # state of the user's class, and loads in plain Keras.
            accumulator.build(var_list, _rank_local_variable)

    def _compute_gradients(self, loss: Any, var_list: Any, grad_loss: Any = None,
                           tape: Any = None) -> list[tuple[Any, Any]]:
        """Horovod's custom-loop API: the gradients of `loss`, reduced across ranks.

        Args:
            loss: The loss, computed under `tape`; or a function of no arguments that
                returns it (then computed here, under `tape` or a new one).
            var_list: The variables, or a function returning them.
            grad_loss: The gradient of the loss itself (None: ones).
            tape: The `tf.GradientTape` that recorded `loss`.

        Returns:
            (gradient, variable) pairs, each gradient reduced as `apply` would reduce it.
            `apply_gradients` applies these very gradients without reducing them again;
            gradients computed from them (clipped, say) are reduced again, which changes
            nothing with `op=Average` and multiplies by the ranks with `op=Sum`. With
            `backward_passes_per_step` > 1, this rank's own gradients: `apply_gradients`
            accumulates them and reduces once per update.

        Example:

            with tf.GradientTape() as tape:
                loss = loss_fn(model(x, training=True), y)
            opt.apply_gradients(opt._compute_gradients(loss, model.trainable_variables,
                                                       tape=tape))
        """
        tape = tf.GradientTape() if tape is None else tape
        if callable(loss):
            with tape:
                if not callable(var_list):
                    tape.watch([_collectives.tf_variable(v) for v in var_list])
                loss = loss()
        if callable(var_list):
            var_list = var_list()
        var_list = list(var_list)
        grads = tape.gradient(loss, [_collectives.tf_variable(v) for v in var_list], grad_loss)
        return list(zip(self._reduced_ahead(grads, var_list), var_list))

    def compute_gradients(self, loss: Any, var_list: Any,
                          tape: Any = None) -> list[tuple[Any, Any]]:
        """`_compute_gradients(loss, var_list, None, tape)`, as Horovod has it."""
        return self._compute_gradients(loss, var_list, None, tape)

    def get_gradients(self, loss: Any, params: Sequence[Any]) -> list[Any]:
        """The gradients of `loss` (a graph tensor) for `params`, reduced across ranks.

        Inside a `tf.function` only, as in Keras 2 (`tf.gradients` has no eager form);
        eager code uses `_compute_gradients(loss, var_list, tape=tape)`.
        """
        if tf.executing_eagerly():
            raise ConfigError("get_gradients works inside a tf.function only (it uses "
                              "tf.gradients, as Keras 2 did); in eager code call "
                              "_compute_gradients(loss, var_list, tape=tape). Received: "
                              "an eager loss")
        params = list(params)
        grads = tf.gradients(loss, [_collectives.tf_variable(param) for param in params])
        return self._reduced_ahead(grads, params)

    def _reduced_ahead(self, grads: Sequence[Any], variables: Sequence[Any]) -> list[Any]:
        """`grads` reduced now, for the next `apply` to apply as they are (with
        accumulation, as they are: `apply` reduces once per update)."""
        reduction = self._hvd_reduction
        if reduction.accumulator is not None:
            return list(grads)
        reduced = reduction.reduce(grads, variables)
        reduction.reduced_ahead = [grad for grad in reduced if grad is not None]
        return reduced

    def apply(self, grads: Sequence[Any], trainable_variables: Sequence[Any] | None = None) -> None:
        if trainable_variables is None:
            trainable_variables = self._trainable_variables
        trainable_variables = list(trainable_variables)
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        apply_update = super().apply
        reduction = self._hvd_reduction

        def reduce_and_apply(grads: Sequence[Any]) -> None:
            apply_update(reduction.reduce(grads, trainable_variables), trainable_variables)

        grads = list(grads)
        present = [grad for grad in grads if grad is not None]
        if present and len(present) == len(reduction.reduced_ahead) and all(
                grad is reduced for grad, reduced in zip(present, reduction.reduced_ahead)):
            reduction.reduced_ahead = []
            apply_update(grads, trainable_variables)
            return

        if reduction.accumulator is None:
            reduce_and_apply(grads)
        else:
            reduction.accumulator.add(grads, reduce_and_apply)


def _rank_local_variable(shape: Any, dtype: str, aggregation: str, name: str) -> Any:
    return keras.Variable(initializer="zeros", shape=shape, dtype=dtype, trainable=False,
                          aggregation=aggregation, synchronization="on_read", name=name)


def _distributed_class(base: type) -> type:
    """`base` with `_DistributedMixin` first: the same name and module, so Keras saves the
    optimizer as `base` and plain Keras loads it."""
    return _named_as(base, (_DistributedMixin, base))


def broadcast_global_variables(root_rank: int) -> None:
    """Refused: TensorFlow 2 has no global variables (Horovod refuses it in eager mode too).

    Use `callbacks.BroadcastGlobalVariablesCallback(root_rank)` with `fit`, or
    `horovod.tensorflow.broadcast_variables(model.variables, root_rank)`.
    """
    raise ConfigError("broadcast_global_variables needs TensorFlow 1 graph collections, which "
                      "TensorFlow 2 does not have; use callbacks.BroadcastGlobalVariables"
                      f"Callback({root_rank}) in fit, or horovod.tensorflow.broadcast_variables("
                      f"model.variables, {root_rank}). Received: root_rank={root_rank}")


def load_model(filepath: Any, custom_optimizers: Sequence[type] | None = None,
               custom_objects: dict[str, Any] | None = None,
               compression: Any = Compression.none, legacy_opts: bool = False) -> Any:
    """Loads a saved Keras model, its optimizer a `DistributedOptimizer` with its state.

    Args:
        filepath: A `.keras` file (Keras 3's format).
        custom_optimizers: Optimizer classes of your own the file uses.
        custom_objects: As `keras.models.load_model`'s.
        compression: The compression of the loaded optimizer's allreduce.
        legacy_opts: Refused: Keras 3 has no legacy optimizers.

    Example:

        model = hvd.load_model("model.keras")
        model.fit(dataset)           # gradients reduced across ranks, state restored
    """
    if legacy_opts:
        raise ConfigError("load_model(legacy_opts=True) loads tf.keras legacy optimizers, which "
                          "Keras 3 does not have; load without legacy_opts. "
                          "Received: legacy_opts=True")
    objects = {cls.__name__: cls for cls in custom_optimizers or ()}
    objects.update(custom_objects or {})
    model = keras.models.load_model(filepath, custom_objects=objects or None)
    optimizer = model.optimizer
    if optimizer is not None and not isinstance(optimizer, _DistributedMixin):
        # The loaded optimizer keeps its variables and state: it becomes its class's
        # DistributedOptimizer in place (the same class name, the same attributes).
        base = type(optimizer)
        optimizer.__class__ = _distributed_class(base)
        optimizer._hvd_reduction = _Reduction(name=f"Distributed{base.__name__}",
                                              compression=compression)
        model.train_function = None
    return model
