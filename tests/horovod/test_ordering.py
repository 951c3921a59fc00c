"""The collectives of a traced step, in one order: buckets of dense gradients, the last
layers' first, each waiting for the one before it (Horovod initialised with 1 rank)."""

import gc
import weakref

import pytest
import tensorflow as tf

from tfdist.horovod import collectives
from tfdist.horovod.ordering import in_step_order

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


def test_a_traced_step_is_not_kept_alive_by_its_order():
    # The order's last collective is kept on the graph it was issued in: a record outside
    # it holding that graph's tensors would keep every traced step alive for good.
    graphs = []

    @tf.function(autograph=False)
    def step(value):
        graphs.append(weakref.ref(tf.compat.v1.get_default_graph()))
        first = in_step_order(lambda: tf.identity(value, name="first"))
        second = in_step_order(lambda: tf.identity(value, name="second"))
        return first + second

    graph = step.get_concrete_function(tf.TensorSpec([], tf.float32)).graph
    second = graph.get_operation_by_name("second")
    assert [op.name for op in second.control_inputs] == ["first"]
    del step, graph, second
    gc.collect()
    assert graphs and graphs[0]() is None
