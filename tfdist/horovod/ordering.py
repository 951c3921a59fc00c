"""The collectives of one traced step, issued in one order on every rank.

Inside a traced train step TensorFlow's executor runs independent ops in whatever
order their inputs come ready, and Grappler rewrites the graph before it runs. Two
Horovod collectives with no edge between them may then wait on each other across
ranks: measured on keras-hub's BERT (a token and a segment Embedding) at
`zero_stage: 1`, rank 0 submitted the segment gradient's allgather and never the
token's, rank 1 the reverse, and both waited until Horovod's stall check shut it down.
With Grappler's model pruning off the same step ran, so the wait comes from a rewrite,
not from the program; no edge between the two collectives was in the traced graph.

`in_step_order` closes that door for every collective tfdist issues in a step: each
one depends on the one issued before it in the same graph, so every rank starts the
k-th only after the (k-1)-th has finished everywhere, whatever the executor or
Grappler do. Horovod still batches what is ready together, within each collective.

Example:

    averaged = in_step_order(lambda: hvd.allreduce(gradient, op=hvd.Average))
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

import tensorflow as tf

Result = TypeVar("Result")

# The outputs of the collective issued last in a graph being traced are kept on the graph
# itself, so a step traced again, and a branch of `tf.cond` (a graph of its own), start
# their own sequence, and they die with the graph: a dictionary keyed by the graph, weakly
# or not, would keep every traced step alive through those tensors.
_LAST_ISSUED = "_tfdist_last_collective"


def in_step_order(issue: Callable[[], Result]) -> Result:
    """Runs `issue()` (which creates collectives) after the last collective issued in
    the same traced graph, and makes its outputs the ones the next must follow.

    Eagerly, ops run one after another already, and `issue()` is simply called.

    Args:
        issue: A function creating one collective (or a group issued as one), returning
            its result: a tensor, a `tf.IndexedSlices`, or a list of them.

    Returns:
        What `issue()` returns.
    """
    if tf.executing_eagerly():
        return issue()
    graph = tf.compat.v1.get_default_graph()
    with tf.control_dependencies(getattr(graph, _LAST_ISSUED, [])):
        result = issue()
    setattr(graph, _LAST_ISSUED, _tensors_of(result))
    return result


def _tensors_of(result: Any) -> list[tf.Tensor]:
    tensors = []
    for value in tf.nest.flatten(result, expand_composites=False):
        if isinstance(value, tf.IndexedSlices):
            tensors += [value.values, value.indices]
        elif isinstance(value, (tf.Tensor, tf.Operation)):
            tensors.append(value)
    return tensors
