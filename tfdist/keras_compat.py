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
