"""A shuffle whose order is fixed by (seed, epoch), so a resumed run sees the same batches.

`tf.data`'s own `shuffle(reshuffle_each_iteration=True)` draws each pass's order
from a generator inside the process: the k-th pass of a fresh process always
gets the same order. Keras 3 starts a new pass every epoch, so a run restarted
at epoch 3 trains epoch 3 on epoch 0's order, and the run is no longer the one
that was interrupted. `EpochShuffle` seeds each pass with (seed, epoch) instead.
The epoch is a variable that `tfdist.backup.BackupAndRestore` sets at the start of
every epoch; without that callback, each pass counts one up, as
`reshuffle_each_iteration` does.

Example:

    shuffle = EpochShuffle(buffer_size=10_000, seed=7)
    dataset = shuffle.apply(examples)    # unbatched in, unbatched out
    shuffle.set_epoch(3)                 # the next pass is epoch 3's order
"""

from __future__ import annotations

import tensorflow as tf
from tensorflow.python.ops import resource_variable_ops

class EpochShuffle:
    """Shuffles each pass over a dataset in the order of (seed, epoch).

    Args:
        buffer_size: Examples in the shuffle buffer; the dataset's length shuffles
            it uniformly.
        seed: The run's seed.

    Example:

        shuffle = EpochShuffle(buffer_size=1797, seed=0)
        train = shuffle.apply(tf.data.Dataset.from_tensor_slices((x, y)))
    """

    def __init__(self, buffer_size: int, seed: int):
        if not isinstance(buffer_size, int) or isinstance(buffer_size, bool) or buffer_size < 1:
            raise ValueError(f"buffer_size must be an integer >= 1. "
                             f"Received: buffer_size={buffer_size!r}")
        if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**31 - 1:
            raise ValueError(f"seed must be an integer from 0 to 2**31 - 2. "
                             f"Received: seed={seed!r}")
        self.buffer_size = buffer_size
        self.seed = seed
        # The next pass's epoch: a plain variable of this process on its CPU. Constructed
        # as a ResourceVariable, which no strategy's variable creator intercepts, so a
        # dataset made inside a strategy's scope does not get a distributed variable.
        with tf.init_scope(), tf.device("/cpu:0"):
            self._next_epoch = resource_variable_ops.ResourceVariable(
                0, dtype=tf.int64, trainable=False, name="tfdist_shuffle_epoch")

    def apply(self, dataset: tf.data.Dataset) -> tf.data.Dataset:
        """`dataset` in the order of the epoch it is iterated in (unbatched in and out).

        The order is decided when a pass starts (a new iterator), not when the
        dataset is built, so one dataset object serves every epoch.
        """
        def one_pass(_: tf.Tensor) -> tf.data.Dataset:
            epoch = self._next_epoch.assign_add(1) - 1
            # The order is the shuffle's (graph seed, op seed) = (seed + 1, epoch). Setting
            # the seed here sets only this function's graph seed: the order does not depend
            # on the process's global seed. It is never 0, which tf.data would compare
            # with a tensor op seed as a Python bool, and fail.
            tf.random.set_seed(self.seed + 1)
            return dataset.shuffle(self.buffer_size, seed=epoch,
                                   reshuffle_each_iteration=False)

        shuffled = tf.data.Dataset.range(1).flat_map(one_pass)
        length = int(dataset.cardinality())
        if length >= 0:
            # flat_map hides the length; Keras needs it for its step count and progress bar.
            shuffled = shuffled.apply(tf.data.experimental.assert_cardinality(length))
        return shuffled

    def set_epoch(self, epoch: int) -> None:
        """Makes the next pass over the dataset use `epoch`'s order."""
        self._next_epoch.assign(int(epoch))
