"""The collectives of a traced step, in one order: buckets of dense gradients, the last
layers' first, each waiting for the one before it (Horovod initialised with 1 rank)."""

import pytest
import tensorflow as tf

from tfdist.horovod import collectives

pytestmark = pytest.mark.requires_horovod

# Float32 gradients of 10, 10, 10, 30 and 5 elements: 40, 40, 40, 120 and 20 bytes.
SIZES = [10, 10, 10, 30, 5]


def test_buckets_hold_about_their_size_the_last_gradients_first():
    grads = [tf.zeros([n]) for n in SIZES]
    # 80-byte buckets, from the last gradient: 20 B; 120 B alone (larger than a bucket);
    # 40 + 40 B; 40 B.
    assert collectives._buckets(grads, list(range(5)), 80) == [[4], [3], [2, 1], [0]]
    assert collectives._buckets(grads, list(range(5)), 10**6) == [[4, 3, 2, 1, 0]]
    assert collectives._buckets(grads, [0, 2], 80) == [[2, 0]]


@pytest.mark.parametrize("grouped, calls", [
    (False, [["grads_4"], ["grads_3"], ["grads_2", "grads_1"], ["grads_0"]]),
    (True, [["grads_0", "grads_1", "grads_2", "grads_3", "grads_4"]]),
])
def test_each_grouped_allreduce_waits_for_the_one_before_it(grouped, calls):
    import horovod.tensorflow as hvd

    hvd.init()
    reduce = collectives.gradient_allreduce(hvd, op=hvd.Average, grouped=grouped,
                                            bucket_bytes=80)

    @tf.function(autograph=False)
    def step(*grads):
        return reduce(list(grads))

    specs = [tf.TensorSpec([n], tf.float32) for n in SIZES]
    graph = step.get_concrete_function(*specs).graph
    issued = [op for op in graph.get_operations() if op.type == "HorovodGroupedAllreduce"]
    # Which gradients each call reduces (the step's inputs are grads_0..grads_4): the last
    # gradient, ready first in the backward pass, goes first.
    assert [[tensor.op.name for tensor in op.inputs] for op in issued] == calls
    for before, after in zip(issued, issued[1:]):
        assert _depends_on(after, before), (before.name, after.name)


def _depends_on(op, earlier):
    """Whether `earlier` is an ancestor of `op`, through data or control edges."""
    seen, stack = set(), [op]
    while stack:
        current = stack.pop()
        if current is earlier:
            return True
        if current.name in seen:
            continue
        seen.add(current.name)
        stack.extend(tensor.op for tensor in current.inputs)
        stack.extend(current.control_inputs)
    return False
