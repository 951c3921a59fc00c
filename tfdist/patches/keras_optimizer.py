"""Patches to Keras 3's TensorFlow optimizer (`keras/src/backend/tensorflow/optimizer.py`).

Four fixes, each acting only where its bug applies:

- **Sparse gradients' repeated rows** (`SUMMED_BEFORE_CLIPPING`). An Embedding's gradient
  is a `tf.IndexedSlices` with one row per lookup, so a token seen twice in a batch
  has two rows. Keras 3's optimizers apply their element-wise ops to those rows
  before anything sums them: Adam's second moment gets g1^2 + g2^2 for that token
  instead of (g1 + g2)^2, and so do RMSprop's, Adagrad's and Adamax's; `clipnorm`
  and `global_clipnorm` measure the rows, not the gradient. Keras 2 summed the
  repeats first (`_deduplicate_indexed_slices`); Keras 3 does not. Measured with
  Keras 3.15 on an Embedding + Dense model, 5 steps of batch 64: Adam ends 0.039 from
  the dense update, Adam with `clipnorm` 0.038, SGD with `global_clipnorm` 8.8e-4
  (`tests/test_sparse_gradients.py` shows it). The replacement sums
  each sparse gradient's repeated rows (`tf.unique` + `unsorted_segment_sum`)
  before clipping and the update, which then equal the dense update exactly;
  SGD, whose update is linear, was right already and stays so.
- **Clipping before the cross-replica sum** (`SUMMED_BEFORE_CLIPPING`, with
  `REPLICA_SUM_ONCE`). Under MirroredStrategy, MultiWorkerMirroredStrategy and
  TPUStrategy, Keras clips each replica's own gradient (`_clip_gradients` in
  `_backend_apply_gradients`) and sums the replicas' gradients only afterwards (in
  `_backend_update_step`), so `clipnorm` and `global_clipnorm` clip parts of the
  gradient, not the gradient (measured: Adam with `global_clipnorm=0.1` on 2
  replicas ends 0.009-0.03 from one device). TensorFlow's Keras 2 refused clipping under a
  strategy for this reason (tensorflow/tensorflow#33929); Keras 3 does it silently.
  The replacement sums the replicas' gradients first, in replica context, with
  Keras's own `_all_reduce_sum_gradients`, then their repeated rows, and Keras's
  later sum is skipped for those gradients (they are summed once). With one replica
  in sync (`one_device`, `horovod`, whose ranks are summed by tfdist's
  optimizer wrapper before Keras sees them, `parameter_server`) only the rows are.
- **Slots of sharded variables** (`SHARDED_SLOT_VARIABLES`). The optimizer creates
  each slot variable (Adam's moments) colocated with the variable it belongs to. A
  ShardedVariable under ParameterServerStrategy cannot be a colocation reference
  ("ShardedVariable doesn't support being used as a reference"), so the optimizer
  fails on its first step (keras-team/keras#18624 left parameter-server training
  unsupported). The replacement creates the slots of a sharded variable without
  colocation, and the strategy's partitioner shards them like the variable; every
  other variable's slots are Keras's own.
- **Slots beside their variables** (`SLOTS_BESIDE_THEIR_VARIABLES`, for `tfdist.parallel`).
  Keras puts a slot beside its variable with `colocate_vars_with`, which in a traced
  function is a graph colocation; the slot variable is created under `tf.init_scope`,
  outside that graph, and lands on the default device. `model.fit` of a model built
  before it builds the optimizer in its first traced step, so every Adam moment of a
  model spread over devices ended on device 0 (measured: a 2-stage pipeline, all 8
  moments on CPU:0). The replacement also opens `tf.device` of the variable, which
  `tf.init_scope` keeps; only in a traced function, outside any tf.distribute strategy
  (whose own placement stands), and never for a ShardedVariable.

Example:

    from tfdist.patches import keras_optimizer

    keras_optimizer.SHARDED_SLOT_VARIABLES.apply()
    patches.apply(patches.EXACT_UPDATES)   # the first two: every adapter applies them
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

from tfdist.patches.base import Patch, source_contains
from tfdist.patches.tensorflow_backprop import shards_of


def _optimizer_class() -> Any:
    from keras.src.backend.tensorflow import optimizer

    return optimizer.TFOptimizer


def _uncolocated_for_shards(original: Callable) -> Callable:
    from keras.src.optimizers import base_optimizer

    def add_variable_from_reference(self, reference_variable, name=None, initializer="zeros"):
        if shards_of(reference_variable) is None:
            return original(self, reference_variable, name=name, initializer=initializer)
        return base_optimizer.BaseOptimizer.add_variable_from_reference(
            self, reference_variable, name=name, initializer=initializer)

    return add_variable_from_reference


SHARDED_SLOT_VARIABLES = Patch(
    "keras.optimizer.sharded_slot_variables",
    owner=_optimizer_class, attribute="add_variable_from_reference",
    replacement=_uncolocated_for_shards,
    bug_present=lambda original: source_contains(original, "colocate_vars_with"),
    upstream="keras-team/keras#18624 (parameter-server training left unsupported)",
    summary="the optimizer cannot create slots for a ShardedVariable: 'ShardedVariable "
            "doesn't support being used as a reference'")


def _colocated_when_traced(original: Callable) -> Callable:
    import tensorflow as tf

    def add_variable_from_reference(self, reference_variable, name=None, initializer="zeros"):
        reference = getattr(reference_variable, "value", reference_variable)
        device = getattr(reference, "device", "")
        if (tf.executing_eagerly() or not device or tf.distribute.has_strategy()
                or shards_of(reference_variable) is not None):
            return original(self, reference_variable, name=name, initializer=initializer)
        with tf.device(device):
            return original(self, reference_variable, name=name, initializer=initializer)

    return add_variable_from_reference


SLOTS_BESIDE_THEIR_VARIABLES = Patch(
    "keras.optimizer.slots_beside_their_variables",
    owner=_optimizer_class, attribute="add_variable_from_reference",
    replacement=_colocated_when_traced,
    bug_present=lambda original: source_contains(original, "colocate_vars_with"),
    upstream="none filed: Keras colocates a slot with `colocate_vars_with`, a graph "
             "colocation that the variable, created under `tf.init_scope`, does not keep",
    summary="an optimizer built in the traced train step (model.fit of a built model) "
            "puts every slot on the default device, not beside its variable")


def sum_repeated_rows(gradient: Any) -> Any:
    """`gradient` with each row index once, its repeats' values summed; dense ones as they are.

    The result densifies to the same tensor as `gradient`, and every element-wise
    update of it (Adam's square, a norm) is then the dense gradient's.

    Args:
        gradient: A `tf.IndexedSlices`, a tensor, or None.

    Example:

        rows = tf.IndexedSlices(tf.ones((3, 2)), tf.constant([4, 1, 4]), (5, 2))
        sum_repeated_rows(rows)   # indices [4, 1], values [[2, 2], [1, 1]]
    """
    import tensorflow as tf

    if not isinstance(gradient, tf.IndexedSlices):
        return gradient
    rows, positions = tf.unique(gradient.indices)
    values = tf.math.unsorted_segment_sum(gradient.values, positions, tf.shape(rows)[0])
    return tf.IndexedSlices(values, rows, gradient.dense_shape)


# Set, in the replica's own thread (MirroredStrategy runs each replica in a thread of its
# own), while Keras applies gradients that were summed across replicas already.
_summed_across_replicas = threading.local()


def _replicas_to_sum_over() -> int:
    """How many replicas Keras would sum this replica's gradients over (1: none)."""
    import tensorflow as tf

    context = tf.distribute.get_replica_context()
    return 1 if context is None else context.num_replicas_in_sync


def _summed_then_applied(original: Callable) -> Callable:
    def _backend_apply_gradients(self, grads: Sequence[Any], trainable_variables: Sequence[Any]):
        grads = list(grads)
        # Keras's own accumulation (`gradient_accumulation_steps`) adds each replica's
        # gradients to its accumulators before the sum; it stays as Keras has it.
        if _replicas_to_sum_over() == 1 or self.gradient_accumulation_steps:
            return original(self, [sum_repeated_rows(g) for g in grads], trainable_variables)
        summed = self._all_reduce_sum_gradients(list(zip(grads, trainable_variables)))
        grads = [sum_repeated_rows(grad) for grad, _ in summed]
        _summed_across_replicas.active = True
        try:
            return original(self, grads, trainable_variables)
        finally:
            _summed_across_replicas.active = False

    return _backend_apply_gradients


def _skipped_when_summed(original: Callable) -> Callable:
    def _all_reduce_sum_gradients(self, grads_and_vars):
        if getattr(_summed_across_replicas, "active", False):
            return list(grads_and_vars)
        return original(self, grads_and_vars)

    return _all_reduce_sum_gradients


def _clips_then_sums(original: Callable) -> bool:
    """Keras clips in `_backend_apply_gradients` and sums replicas later, without
    summing a sparse gradient's repeated rows anywhere on the way."""
    from keras.src.optimizers import base_optimizer

    return (source_contains(original, "_clip_gradients")
            and source_contains(_optimizer_class()._backend_update_step,
                                "_all_reduce_sum_gradients")
            and not any(source_contains(method, "unique") or source_contains(method, "dedup")
                        for method in (original, base_optimizer.BaseOptimizer.apply)))


SUMMED_BEFORE_CLIPPING = Patch(
    "keras.optimizer.summed_before_clipping",
    owner=_optimizer_class, attribute="_backend_apply_gradients",
    replacement=_summed_then_applied, bug_present=_clips_then_sums,
    upstream="none filed: Keras 3 dropped Keras 2's _deduplicate_indexed_slices; "
             "clipping before the replicas' sum: tensorflow/tensorflow#33929",
    summary="a sparse gradient's repeated rows are squared (Adam, RMSprop, Adagrad) and "
            "clipped before they are summed, and under a multi-replica strategy each "
            "replica's gradient is clipped before the replicas' sum")

REPLICA_SUM_ONCE = Patch(
    "keras.optimizer.replica_sum_once",
    owner=_optimizer_class, attribute="_all_reduce_sum_gradients",
    replacement=_skipped_when_summed,
    bug_present=lambda original: (source_contains(original, "all_reduce")
                                  and SUMMED_BEFORE_CLIPPING.bug_present()),
    upstream="the second half of keras.optimizer.summed_before_clipping",
    summary="gradients summed across replicas before clipping would be summed again")
