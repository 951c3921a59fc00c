"""Patches to Keras 3's synchronized batch statistics (`keras/src/backend/tensorflow/nn.py`).

`keras.layers.BatchNormalization(synchronized=True)` sums its batch moments with
`tf.distribute.get_replica_context().all_reduce`, which reaches the replicas of
the current `tf.distribute` strategy only. Horovod is not a strategy: each rank
trains one replica, so every rank normalised with its own slice's statistics and
the model trained differently from one device on the global batch. Horovod's
`SyncBatchNormalization` (the fix for Keras 2) cannot be built on Keras 3 (it
passes `fused`, which Keras 3 refuses).

The replacement sums the moments over Horovod's ranks too (one grouped allreduce
of the sum, the sum of squares and the count, whose gradient is the allreduce of
theirs), only when Horovod is initialised with more than one rank and the strategy
in this process has a single replica; everywhere else it is Keras's own code.

Example:

    from tfdist.patches import keras_normalization

    keras_normalization.HOROVOD_SYNCHRONIZED_MOMENTS.apply()
"""

from __future__ import annotations

import sys
from typing import Any, Callable

from tfdist.patches.base import Patch, source_contains


def _nn_module() -> Any:
    from keras.src.backend.tensorflow import nn

    return nn


def initialized_horovod() -> Any:
    """`horovod.tensorflow` when a program has imported and initialised it, else None.

    Never imports Horovod: a program that does not use it has not imported it.
    """
    hvd = sys.modules.get("horovod.tensorflow")
    if hvd is None or not hvd.is_initialized():
        return None
    return hvd


def _over_horovod_ranks(original: Callable) -> Callable:
    import tensorflow as tf

    def compute_moments_sync(x, axes, keepdims):
        hvd = initialized_horovod()
        context = tf.distribute.get_replica_context()
        if (hvd is None or hvd.size() == 1
                or (context is not None and context.num_replicas_in_sync > 1)):
            return original(x, axes, keepdims)
        local = [tf.reduce_sum(x, axis=axes, keepdims=True),
                 tf.reduce_sum(tf.square(x), axis=axes, keepdims=True),
                 tf.reduce_sum(tf.ones_like(x), axis=axes, keepdims=True)]
        total, squared_total, count = hvd.grouped_allreduce(local, op=hvd.Sum)
        mean = tf.math.divide_no_nan(total, count)
        # var = E(x^2) - E(x)^2, as Keras computes it across replicas.
        variance = tf.maximum(tf.math.divide_no_nan(squared_total, count) - tf.square(mean),
                              0.0)
        if not keepdims:
            mean, variance = tf.squeeze(mean, axes), tf.squeeze(variance, axes)
        return mean, variance

    compute_moments_sync.__name__ = original.__name__
    return compute_moments_sync


HOROVOD_SYNCHRONIZED_MOMENTS = Patch(
    "keras.normalization.horovod_synchronized_moments",
    owner=_nn_module, attribute="_compute_moments_sync", replacement=_over_horovod_ranks,
    bug_present=lambda original: (source_contains(original, "replica_ctx.all_reduce")
                                  and not source_contains(original, "horovod")),
    upstream="none: Keras syncs over tf.distribute replicas only, and Horovod is not a "
             "strategy; horovod's SyncBatchNormalization fails on Keras 3 (`fused`)",
    summary="BatchNormalization(synchronized=True) under Horovod normalises each rank's "
            "slice with its own statistics")
