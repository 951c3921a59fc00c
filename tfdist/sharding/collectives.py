"""What sharding needs from a communicator, apart from any one communicator.

`tfdist.sharding` asks for four collectives, each called inside the traced train step
on every rank in the same order; `tfdist.horovod.collectives.ShardCollectives` implements
them on Horovod. Another communicator (tf.distribute's collectives, say) would implement
the same four.

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

    def average_slice(self, flat: tf.Tensor) -> tf.Tensor:
        """Rank r's equal slice of `flat` (1-D, a multiple of `size` long), averaged."""
        raise NotImplementedError

    def concatenate(self, flat: tf.Tensor) -> tf.Tensor:
        """Every rank's `flat` (1-D, any length) concatenated in rank order."""
        raise NotImplementedError

    def sum(self, values: tf.Tensor) -> tf.Tensor:
        """`values` summed across ranks."""
        raise NotImplementedError
