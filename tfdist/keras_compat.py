"""Targeted fixes for Keras 3 bugs that break distributed training.

Each fix names its upstream issue, applies only where the installed Keras still
has the bug (checked on the code itself, not guessed from a version number), is
applied by the adapter that needs it when that adapter is built (never on
`import tfdist`), and has a test that fails without it. The user's model
classes are not touched.

Example:

    keras_compat.apply_multi_worker_fixes()   # the names of the fixes applied now
"""

from __future__ import annotations

import inspect
import threading

_lock = threading.Lock()


def _trainer_module():
    from keras.src.backend.tensorflow import trainer

    return trainer


def _tensorflow_trainer():
    return _trainer_module().TensorFlowTrainer


def apply_multi_worker_fixes() -> list[str]:
    """Applies every fix MultiWorkerMirroredStrategy needs under this Keras.

    Returns:
        The names of the fixes applied by this call (empty when none was needed).
    """
    applied = []
    if fix_symbolic_build_for_multi_worker():
        applied.append("symbolic_build")
    if fix_metric_reduction_for_multi_worker():
        applied.append("metric_reduction")
    return applied


def undo_multi_worker_fixes() -> None:
    """Restores Keras's own code (for tests that show the bugs)."""
    undo_symbolic_build_fix()
    with _lock:
        module = _trainer_module()
        if getattr(module.reduce_per_replica, "_tfdist_fix", False):
            module.reduce_per_replica = module.reduce_per_replica.__wrapped__


def metric_reduction_uses_axis_0() -> bool:
    """Whether Keras averages multi-worker step outputs over axis 0.

    In multi-worker mode Keras 3 reduces each step's outputs (the metric values,
    scalars) with `strategy.reduce("MEAN", value, axis=0)`, and a scalar has no
    axis 0: `ValueError: Invalid reduction dimension 0 for input with 0
    dimensions` (tensorflow/tensorflow#72388).
    """
    function = _trainer_module().reduce_per_replica
    if getattr(function, "_tfdist_fix", False):
        return False
    try:
        return 'strategy.reduce("MEAN", v, axis=0)' in inspect.getsource(function)
    except (OSError, TypeError):
        return False


def fix_metric_reduction_for_multi_worker() -> bool:
    """Averages multi-worker step outputs across replicas (`axis=None`), as one worker does.

    On one worker Keras averages the replicas' values with
    `tf.reduce_mean(local_results, axis=0)`: the mean across replicas. With several
    workers the same mean is `strategy.reduce("MEAN", value, axis=None)`. Other
    reductions ("first", "sum", "concat") are left to Keras.

    Returns:
        True if the fix was applied now.
    """
    with _lock:
        if not metric_reduction_uses_axis_0():
            return False
        from keras.src import tree

        module = _trainer_module()
        original = module.reduce_per_replica

        def reduce_per_replica(values, strategy, reduction):
            if reduction in ("auto", "mean") and module._collective_all_reduce_multi_worker(
                    strategy):
                return tree.map_structure(
                    lambda value: strategy.reduce("MEAN", value, axis=None), values)
            return original(values, strategy, reduction)

        reduce_per_replica._tfdist_fix = True
        reduce_per_replica.__wrapped__ = original
        module.reduce_per_replica = reduce_per_replica
        return True


def symbolic_build_reduces_data() -> bool:
    """Whether Keras's `_maybe_symbolic_build` still reduces a data batch across replicas.

    Keras 3 (keras-team/keras#20585, tensorflow/tensorflow#72388) builds the model
    from the first batch of `fit`, and under a strategy it first averages that
    batch across replicas with `strategy.reduce("MEAN", ...)`. Under
    MultiWorkerMirroredStrategy that reduce cannot take the per-replica data
    batch: `ValueError: Attempt to convert a value (PerReplica...)`.
    """
    method = getattr(_tensorflow_trainer(), "_maybe_symbolic_build", None)
    if method is None or getattr(method, "_tfdist_fix", False):
        return False
    try:
        return "distribute_strategy.reduce" in inspect.getsource(method)
    except (OSError, TypeError):  # No source to read: assume the bug is fixed.
        return False


def fix_symbolic_build_for_multi_worker() -> bool:
    """Builds the model from this worker's first replica's slice of the batch.

    Building only needs the batch's shapes and dtypes, which every replica's slice
    has, so no collective is needed at all. Everything else `_maybe_symbolic_build`
    does is unchanged.

    Returns:
        True if the fix was applied now; False if this Keras does not need it or it
        was applied before.
    """
    with _lock:
        if not symbolic_build_reduces_data():
            return False
        import tensorflow as tf
        from keras.src import tree

        trainer_cls = _tensorflow_trainer()
        original = trainer_cls._maybe_symbolic_build

        def _maybe_symbolic_build(self, iterator=None, data_batch=None):
            if iterator is not None and self._distribute_strategy is not None:
                for _, _, batches in iterator:
                    data_batch = tree.map_structure(
                        lambda value: (
                            self.distribute_strategy.experimental_local_results(value)[0]
                            if isinstance(value, tf.distribute.DistributedValues) else value),
                        next(batches))
                    break
                iterator = None
            return original(self, iterator=iterator, data_batch=data_batch)

        _maybe_symbolic_build._tfdist_fix = True
        _maybe_symbolic_build.__wrapped__ = original
        trainer_cls._maybe_symbolic_build = _maybe_symbolic_build
        return True


def undo_symbolic_build_fix() -> None:
    """Restores Keras's own `_maybe_symbolic_build` (for tests that show the bug)."""
    with _lock:
        trainer_cls = _tensorflow_trainer()
        method = trainer_cls._maybe_symbolic_build
        if getattr(method, "_tfdist_fix", False):
            trainer_cls._maybe_symbolic_build = method.__wrapped__


# --- parameter-server training ------------------------------------------------------------


def apply_parameter_server_fixes() -> list[str]:
    """Applies every fix ParameterServerStrategy needs under this Keras.

    Returns:
        The names of the fixes applied by this call (empty when none was needed).
    """
    applied = []
    if fix_atomic_variable_updates():
        applied.append("atomic_variable_updates")
    if fix_sharded_variable_gradients():
        applied.append("sharded_variable_gradients")
    if fix_sharded_variable_updates():
        applied.append("sharded_variable_updates")
    return applied


def _tensorflow_variable_cls():
    from keras.src.backend.tensorflow import core

    return core.Variable


def variable_assign_add_reads_then_writes() -> bool:
    """Whether Keras's `Variable.assign_add` is `assign(self + value)` under TensorFlow.

    Keras 3 implements `assign_add` and `assign_sub` as a read followed by an
    assign (`keras/src/backend/common/variables.py`). Under ParameterServerStrategy
    workers update the same variable on a parameter server concurrently, and two
    steps that read the same value both write value + 1: increments are lost.
    `optimizer.iterations` read 19 after 20 scheduled steps with 2 workers, which
    shifts learning-rate schedules and Adam's bias correction, and loss/metric
    totals lose updates the same way (keras-team/keras#18624 left parameter-server
    training unsupported; no Keras release has atomic updates).
    """
    method = _tensorflow_variable_cls().assign_add
    if getattr(method, "_tfdist_fix", False):
        return False
    try:
        return "self.assign(self + value)" in inspect.getsource(method)
    except (OSError, TypeError):
        return False


def fix_atomic_variable_updates() -> bool:
    """Makes Keras's TensorFlow `Variable.assign_add`/`assign_sub` one atomic update.

    They call the TensorFlow variable's own `assign_add`/`assign_sub`
    (`AssignAddVariableOp`, applied under the variable's lock on the server that
    holds it), with the same cast Keras's `assign` does.

    Returns:
        True if the fix was applied now.
    """
    with _lock:
        if not variable_assign_add_reads_then_writes():
            return False
        import tensorflow as tf

        variable_cls = _tensorflow_variable_cls()

        def atomic(name: str):
            original = getattr(variable_cls, name)

            def update(self, value):
                if isinstance(value, tf.IndexedSlices) or self._value is None:
                    return original(self, value)
                return getattr(self._value, name)(tf.cast(value, self._value.dtype))

            update.__name__ = name
            update._tfdist_fix = True
            update.__wrapped__ = original
            return update

        variable_cls.assign_add = atomic("assign_add")
        variable_cls.assign_sub = atomic("assign_sub")
        return True


def _sharded_variable_cls():
    from tensorflow.python.distribute import sharded_variable

    return sharded_variable.ShardedVariable


def _shards_of(source):
    """The shard variables behind a Keras variable or a ShardedVariable, else None."""
    sharded_cls = _sharded_variable_cls()
    value = getattr(source, "_value", None) if isinstance(
        source, _tensorflow_variable_cls()) else source
    return list(value.variables) if isinstance(value, sharded_cls) else None


def _join_shard_gradients(gradients, shards):
    """One gradient for the whole variable from its shards' gradients (rows in order)."""
    import tensorflow as tf

    if all(gradient is None for gradient in gradients):
        return None
    if all(isinstance(gradient, tf.IndexedSlices) or gradient is None for gradient in gradients):
        offsets, values, indices = 0, [], []
        for gradient, shard in zip(gradients, shards):
            if gradient is not None:
                values.append(gradient.values)
                indices.append(tf.cast(gradient.indices, tf.int64) + offsets)
            offsets += shard.shape[0]
        return tf.IndexedSlices(tf.concat(values, 0), tf.concat(indices, 0),
                                dense_shape=[offsets, *shards[0].shape[1:]])
    return tf.concat([tf.zeros(shard.shape, shard.dtype) if gradient is None
                      else tf.convert_to_tensor(gradient)
                      for gradient, shard in zip(gradients, shards)], axis=0)


def fix_sharded_variable_gradients() -> bool:
    """Lets `GradientTape.gradient` take Keras variables that hold a ShardedVariable.

    With a variable partitioner, ParameterServerStrategy gives a large Keras
    variable a `ShardedVariable` (one TensorFlow variable per shard, on different
    servers). `tape.gradient(loss, model.trainable_weights)` then fails in
    Keras's `train_step`: `AttributeError: 'ShardedVariable' object has no
    attribute 'handle'` (TensorFlow differentiates with respect to variable
    handles, and a ShardedVariable has one per shard). The fix asks the tape for
    each shard's gradient and joins them in row order: dense gradients
    concatenated, sparse ones (embedding lookups) as one `IndexedSlices`.

    Returns:
        True if the fix was applied now.
    """
    with _lock:
        import tensorflow as tf

        tape_cls = tf.GradientTape
        if getattr(tape_cls.gradient, "_tfdist_fix", False):
            return False
        original = tape_cls.gradient

        def gradient(self, target, sources, output_gradients=None,
                     unconnected_gradients=tf.UnconnectedGradients.NONE):
            flat_sources = tf.nest.flatten(sources)
            shards = [_shards_of(source) for source in flat_sources]
            if not any(shards):
                return original(self, target, sources, output_gradients, unconnected_gradients)
            expanded = [parts if parts else [source]
                        for source, parts in zip(flat_sources, shards)]
            gradients = original(self, target, expanded, output_gradients,
                                 unconnected_gradients)
            joined = [_join_shard_gradients(parts_gradients, parts) if parts
                      else parts_gradients[0]
                      for parts_gradients, parts in zip(gradients, shards)]
            return tf.nest.pack_sequence_as(sources, joined)

        gradient._tfdist_fix = True
        gradient.__wrapped__ = original
        tape_cls.gradient = gradient
        return True


def fix_sharded_variable_updates() -> bool:
    """Lets the Keras optimizer update a ShardedVariable under ParameterServerStrategy.

    Keras's TensorFlow optimizer applies each update through
    `strategy.extended.update(variable.value, ...)`, and ParameterServerStrategy
    refuses a ShardedVariable there ("You can not update `var` ... It must be a
    Variable"): it only colocates the update with one variable. A ShardedVariable
    places each shard's part of the update on that shard's server itself
    (`assign_sub`, `scatter_sub` split by rows), so the fix calls the update
    directly for it. Creating the optimizer's slot variables fails the same way
    (`colocate_vars_with` a ShardedVariable: "ShardedVariable doesn't support
    being used as a reference"); they are created without colocation, and the
    strategy's partitioner shards them like the variable they belong to.

    Returns:
        True if the fix was applied now.
    """
    with _lock:
        from tensorflow.python.distribute import distribute_lib, parameter_server_strategy_v2

        extended_cls = parameter_server_strategy_v2.ParameterServerStrategyV2Extended
        if getattr(extended_cls._update, "_tfdist_fix", False):
            return False
        original = extended_cls._update
        sharded_cls = _sharded_variable_cls()

        def _update(self, var, fn, args, kwargs, group):
            if not isinstance(var, sharded_cls):
                return original(self, var, fn, args, kwargs, group)
            with distribute_lib.UpdateContext(var.variables[0].device):
                return fn(var, *self._select_single_value(args),
                          **self._select_single_value(kwargs))

        _update._tfdist_fix = True
        _update.__wrapped__ = original
        extended_cls._update = _update

        from keras.src.backend.tensorflow import optimizer as tf_optimizer
        from keras.src.optimizers import base_optimizer

        optimizer_cls = tf_optimizer.TFOptimizer
        original_add = optimizer_cls.add_variable_from_reference

        def add_variable_from_reference(self, reference_variable, name=None,
                                        initializer="zeros"):
            if _shards_of(reference_variable) is None:
                return original_add(self, reference_variable, name=name,
                                    initializer=initializer)
            return base_optimizer.BaseOptimizer.add_variable_from_reference(
                self, reference_variable, name=name, initializer=initializer)

        add_variable_from_reference._tfdist_fix = True
        add_variable_from_reference.__wrapped__ = original_add
        optimizer_cls.add_variable_from_reference = add_variable_from_reference
        return True
