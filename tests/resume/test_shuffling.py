"""EpochShuffle: each pass's order is fixed by (seed, epoch), in any process."""

import os
import subprocess
import sys

import pytest
import tensorflow as tf

from tfdist.resume.shuffling import EpochShuffle, PipelineReplay

EXAMPLES = 50


def ids():
    return tf.data.Dataset.range(EXAMPLES)


def one_pass(dataset):
    return [int(value) for value in dataset]


def test_each_pass_is_a_permutation_and_the_length_is_known():
    shuffled = EpochShuffle(EXAMPLES, seed=3).apply(ids())
    assert int(shuffled.cardinality()) == EXAMPLES  # Keras counts its steps from it
    order = one_pass(shuffled)
    assert sorted(order) == list(range(EXAMPLES)) and order != list(range(EXAMPLES))


def test_set_epoch_fixes_the_order_of_the_next_pass():
    shuffle = EpochShuffle(EXAMPLES, seed=3)
    dataset = shuffle.apply(ids())
    passes = {}
    for epoch in (0, 1, 2, 1, 0):
        shuffle.set_epoch(epoch)
        passes.setdefault(epoch, []).append(one_pass(dataset))
    assert all(first == again for first, again in (orders for orders in passes.values()
                                                   if len(orders) == 2))
    assert len({tuple(orders[0]) for orders in passes.values()}) == 3


def test_without_set_epoch_each_pass_counts_up_like_reshuffling():
    shuffle = EpochShuffle(EXAMPLES, seed=3)
    dataset = shuffle.apply(ids())
    first, second = one_pass(dataset), one_pass(dataset)
    assert first != second
    shuffle.set_epoch(1)
    assert one_pass(dataset) == second


@pytest.mark.multiprocess
def test_the_order_is_the_same_in_a_new_process_and_depends_on_the_seed():
    code = ("import tensorflow as tf; from tfdist.resume.shuffling import EpochShuffle; "
            "s = EpochShuffle(50, seed={seed}); d = s.apply(tf.data.Dataset.range(50)); "
            "s.set_epoch(4); print([int(v) for v in d])")
    here = EpochShuffle(EXAMPLES, seed=3)
    dataset = here.apply(ids())
    here.set_epoch(4)
    for seed, same in ((3, True), (4, False)):
        printed = subprocess.run([sys.executable, "-c", code.format(seed=seed)],
                                 capture_output=True, text=True, check=True,
                                 env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}).stdout
        assert (printed.strip() == str(one_pass(dataset))) is same


def test_made_inside_a_strategy_scope_the_epoch_stays_a_plain_variable():
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        shuffle = EpochShuffle(EXAMPLES, seed=3)
    assert not isinstance(shuffle._next_epoch, tf.distribute.DistributedValues)


@pytest.mark.parametrize("buffer_size", [0, -1, 2.5, True])
def test_a_bad_buffer_size_is_one_line(buffer_size):
    with pytest.raises(ValueError, match=f"buffer_size must be an integer >= 1. Received: "
                                         f"buffer_size={buffer_size!r}"):
        EpochShuffle(buffer_size, seed=0)


def _orders(dataset, passes):
    return [[int(x) for batch in dataset for x in batch] for _ in range(passes)]


def test_a_replay_gives_the_next_pass_the_order_an_uninterrupted_run_had():
    def pipeline():
        return tf.data.Dataset.range(12).shuffle(12, seed=3).batch(4)

    # Keras creates 2 iterators per epoch over data of known length, so epoch 2 of an
    # uninterrupted fit reads pass 4 (after epochs 0 and 1 took passes 0-3).
    uninterrupted = _orders(pipeline(), 5)
    assert len({tuple(order) for order in uninterrupted}) == 5  # it reshuffles
    replay = PipelineReplay()
    resumed = replay.track(pipeline())
    replay.advance(epochs=2)
    assert _orders(resumed, 1) == [uninterrupted[4]]
    assert replay.unreproducible() is None


def test_a_replay_says_in_one_line_what_it_cannot_reproduce():
    replay = PipelineReplay()
    assert "not made with runner.dataset" in replay.unreproducible()
    tf.random.set_seed(None)  # an earlier test's global seed would seed the shuffle
    replay.track(tf.data.Dataset.range(4).shuffle(4))
    assert "has no seed" in replay.unreproducible()
    endless = PipelineReplay()
    endless.track(tf.data.Dataset.range(4).shuffle(4, seed=1).repeat())
    assert "repeats without end" in endless.unreproducible()
    seeded = PipelineReplay()
    seeded.track(tf.data.Dataset.range(4).shuffle(4, seed=1, reshuffle_each_iteration=False))
    assert seeded.unreproducible() is None
