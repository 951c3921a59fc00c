"""Data order at a resume: tfdist's shuffle by (seed, epoch), and the user's own shuffles replayed.

`tf.data`'s own `shuffle(reshuffle_each_iteration=True)` draws each pass's order
from a generator inside the process: the k-th pass of a fresh process always
gets the same order. Keras 3 starts a new pass every epoch, so a run restarted
at epoch 3 trains epoch 3 on epoch 0's order, and the run is no longer the one
that was interrupted. `EpochShuffle` seeds each pass with (seed, epoch) instead.
The epoch is a variable that `tfdist.resume.backup.BackupAndRestore` sets at the start of
every epoch; without that callback, each pass counts one up, as
`reshuffle_each_iteration` does.

A pipeline's own seeded `shuffle` (`reshuffle_each_iteration=True`, tf.data's default)
is reproducible too: its k-th order is drawn when the k-th iterator over the dataset is
created, reading nothing. `PipelineReplay` creates, at a resume in epoch e, the
iterators that epochs 0 to e-1 created in the interrupted run, so epoch e gets its own
order again; it says in one line where an order cannot be reproduced (a shuffle
without a seed, data that never ends, data tfdist did not see).

Example:

    shuffle = EpochShuffle(buffer_size=10_000, seed=7)
    dataset = shuffle.apply(examples)    # unbatched in, unbatched out
    shuffle.set_epoch(3)                 # the next pass is epoch 3's order

    replay = PipelineReplay()
    data = replay.track(batched)         # what model.fit gets
    replay.advance(epochs=3)             # at a resume in epoch 3
"""

from __future__ import annotations

from typing import Any

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


class PipelineReplay:
    """Replays, at a resume, the passes the user's own pipelines made before the resumed epoch.

    tf.data draws a reshuffling `shuffle`'s order for each new iterator from a
    generator that starts afresh in every process. Keras 3 creates an iterator at
    the start of every epoch and, when the number of batches is known, one more at
    its end (`EpochIterator._enumerate_iterator`, keras/src/trainers/epoch_iterator.py);
    before its first epoch a resumed process has created the same ones as the
    interrupted run (to build the model). So a process resumed in epoch e would
    train epoch e on the order the interrupted run had for its first epoch.
    `advance(e)` creates the missing iterators, without reading from them.

    Under `parameter_server` each worker iterates its own copy of the pipeline, and
    the order is not reproduced (see docs/guide/restarts.md).

    Example:

        replay = PipelineReplay()
        data = replay.track(runner_dataset)
        replay.advance(epochs=2)   # the next iterator gets the order of epoch 2
    """

    def __init__(self) -> None:
        self._datasets: list[Any] = []

    def track(self, dataset: Any) -> Any:
        """Remembers a dataset `model.fit` may iterate, and returns it."""
        self._datasets.append(dataset)
        return dataset

    def advance(self, epochs: int) -> None:
        """Creates the iterators `epochs` epochs of `fit` created, over every tracked
        dataset whose order depends on them."""
        for dataset in self._datasets:
            if not isinstance(dataset, tf.data.Dataset) or _shuffles(dataset):
                for _ in range(epochs * _iterators_per_epoch(dataset)):
                    iter(dataset)

    def unreproducible(self) -> str | None:
        """One line saying why a resumed epoch's order differs from the interrupted run's.

        None when tfdist made every pipeline it was given reproducible: a `fit` on data
        not made with `runner.dataset`, or a shuffle without a seed (and no global
        seed), cannot be.
        """
        if not self._datasets:
            return ("the data was not made with runner.dataset, so its order cannot be "
                    "replayed: if it shuffles, the resumed epoch's order differs from the "
                    "interrupted run's; pass it through runner.dataset")
        if any(_batches(dataset) == tf.data.INFINITE_CARDINALITY for dataset in self._datasets):
            return ("the input data repeats without end, so a resumed run reads it from its "
                    "start, not where the interrupted run was; pass data that ends with "
                    "each epoch (no .repeat(), no steps_per_epoch)")
        if any(_unseeded(shuffle) for dataset in self._datasets
               if isinstance(dataset, tf.data.Dataset) for shuffle in _shuffles(dataset)):
            return ("a shuffle in the input pipeline has no seed, so the resumed epoch's order "
                    "differs from the interrupted run's; give it one "
                    "(dataset.shuffle(n, seed=...)), or shuffle with "
                    "runner.dataset(..., shuffle_buffer_size=n)")
        return None


def _shuffles(dataset: tf.data.Dataset) -> list[Any]:
    """The `shuffle` steps of a pipeline (its own; not those inside its functions)."""
    found, pending, seen = [], [dataset], set()
    while pending:
        node = pending.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if type(node).__name__ == "_ShuffleDataset":
            found.append(node)
        pending.extend(node._inputs())
    return found


def _batches(dataset: Any) -> int:
    """The number of batches, as `cardinality` says (negative: unknown or infinite)."""
    cardinality = getattr(dataset, "cardinality", None)
    return int(cardinality()) if callable(cardinality) else tf.data.UNKNOWN_CARDINALITY


def _iterators_per_epoch(dataset: Any) -> int:
    """Iterators Keras 3's `fit` creates over `dataset` in one epoch (see `PipelineReplay`)."""
    return 2 if _batches(dataset) >= 0 else 1


def _unseeded(shuffle: Any) -> bool:
    """Whether a `shuffle` step draws its seeds at random: tf.data stores (0, 0) when it was
    given no seed and no global seed was set (tensorflow/python/data/util/random_seed.py)."""
    return int(shuffle._seed) == 0 and int(shuffle._seed2) == 0
