"""What sharding needs from a communicator, apart from any one communicator.

`tfdist.sharding` asks for these collectives, each called inside the traced train step
on every rank in the same order; `tfdist.horovod.collectives.ShardCollectives` implements
them on Horovod. Another communicator (tf.distribute's collectives, say) would implement
the same ones.

Example:

    class MyCollectives(ShardCollectives):
        rank, size = 0, 1

        def average(self, grads):
            return grads
        ...
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf


class ShardCollectives:
    """What sharding needs from a communicator; `tfdist.horovod.collectives` implements it.

    Every method runs inside the traced train step, on every rank, in the same order.

    Attributes:
        rank: This rank.
        size: The number of ranks.
    """

    rank: int
    size: int

    def average(self, grads: list[Any]) -> list[Any]:
        """The gradients (tensors or `tf.IndexedSlices`) averaged across ranks."""
        raise NotImplementedError

    def concatenate(self, flat: tf.Tensor) -> tf.Tensor:
        """Every rank's `flat` (1-D, any length) concatenated in rank order."""
        raise NotImplementedError

    def sum(self, values: tf.Tensor) -> tf.Tensor:
        """`values` summed across ranks."""
        raise NotImplementedError

    def gather(self, flat: tf.Tensor, name: str) -> tf.Tensor:
        """Every rank's `flat` (1-D, the same length on every rank) concatenated in rank
        order, as an op named `name` on every rank (zero_stage 2 and 3: a weight's
        slices)."""
        raise NotImplementedError

    def reduce_scatter(self, flat: tf.Tensor, name: str) -> tf.Tensor:
        """Rank r's equal slice of `flat` (1-D, a multiple of `size` long) averaged across
        ranks, as an op named `name` (zero_stage 2 and 3: a weight's gradient, in the
        backward pass)."""
        raise NotImplementedError

    def broadcast(self, value: tf.Tensor, name: str) -> tf.Tensor:
        """Rank 0's `value`, on every rank (zero_stage 3: a weight's initial value)."""
        raise NotImplementedError

    def before_update(self) -> None:
        """Called once per update, in the step, before the optimizer updates (zero_stage 2
        and 3: the gradients were reduced in the backward pass already)."""


class OneRankCollectives(ShardCollectives):
    """The communicator of a run of one rank: every collective gives back what it is given.

    The sharding code runs whole in one process with it: each stage builds, updates,
    gathers and saves as on N ranks, with N = 1, and must equal plain Keras exactly. The
    sharding's fast tests use it; a one-process run of a ZeRO configuration can too.

    Example:

        optimizer = sharded_optimizer(keras.optimizers.Adam(1e-3), OneRankCollectives(), 2)
    """

    rank, size = 0, 1

    def average(self, grads: list[Any]) -> list[Any]:
        return list(grads)

    def concatenate(self, flat: tf.Tensor) -> tf.Tensor:
        return tf.identity(flat)

    def sum(self, values: tf.Tensor) -> tf.Tensor:
        return tf.identity(values)

    def gather(self, flat: tf.Tensor, name: str) -> tf.Tensor:
        return tf.identity(flat, name=name)

    def reduce_scatter(self, flat: tf.Tensor, name: str) -> tf.Tensor:
        return tf.identity(flat, name=name)

    def broadcast(self, value: tf.Tensor, name: str) -> tf.Tensor:
        return tf.identity(value, name=name)

    def before_update(self) -> None:
        pass
