"""Weights stored sharded (ZeRO stage 3): each rank holds 1/N of every trainable variable.

Under `sharded_creation(collectives)`, each trainable variable a Keras layer creates
is stored on this rank as its slice only: the initial value is computed, made rank
0's (a broadcast), flattened, padded to N equal slices, and all but this rank's slice
dropped, one variable at a time, as DeepSpeed's `zero.Init` does. So the whole model
never exists on one rank.

The Keras variable stays the user's own (its name, path and shape are the whole
variable's); what it holds in place of its `tf.Variable` is a `ShardedWeight`. Every
read of it (a layer's `self.kernel` in its `call`) is an all-gather of the slices,
whose gradient is a reduce-scatter: the backward pass turns each weight's gradient
into this rank's averaged slice as soon as the layer's gradient exists, so the whole
gradient of the model never exists at once. The optimizer (`tfdist.sharding.optimizer`)
then updates the rank's slices in place; no weights are gathered after the update.

Example:

    with sharded_creation(collectives):
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
    model.layers[0].kernel.value        # a ShardedWeight; read in a step: all 32 elements
    model.layers[0].kernel.value.shard  # this rank's 16 (of 2 ranks)
"""

from __future__ import annotations

import contextlib
import itertools
import math
from typing import Any, Callable, Iterator

import numpy as np
import tensorflow as tf

from tfdist.sharding.collectives import ShardCollectives


class ShardedWeight:
    """What a Keras variable holds at zero_stage 3 in place of its `tf.Variable`.

    `shard` is this rank's slice of the flattened variable, padded so that every rank's
    slice is `width` long. Reading it (`tf.convert_to_tensor`, which is how Keras reads
    its variables) gathers the whole value; the gradient of that read with respect to
    `shard` is this rank's slice of the gradient, averaged across ranks. Assigning a
    whole value stores this rank's slice of it.

    Args:
        shard: This rank's slice, a `tf.Variable` of shape `[width]`.
        shape: The whole variable's shape.
        collectives: The ranks' communicator.
        index: The variable's place in creation order: it names the variable's
            collectives, identically on every rank.

    Example:

        weight = keras_variable.value      # under sharded_creation
        weight.shard.shape                  # [ceil(size / N)]
        tf.convert_to_tensor(weight).shape  # the whole shape (a collective)
    """

    _should_act_as_resource_variable = True

    def __init__(self, shard: tf.Variable, shape: tf.TensorShape, collectives: ShardCollectives,
                 index: int):
        self.shard = shard
        self.whole_shape = tf.TensorShape(shape)
        self.size = int(self.whole_shape.num_elements())
        self.width = int(shard.shape[0])
        self._collectives = collectives
        self._index = index
        # The whole value gathered at the end of a fit, for `model.save()` on the chief
        # alone, and the optimizer step it belongs to (`version()` is the current step).
        self.saved: tuple[int, np.ndarray] | None = None
        self.version: Callable[[], int] | None = None

    # --- what Keras and TensorFlow read of a variable ----------------------------------

    @property
    def dtype(self) -> tf.DType:
        return self.shard.dtype

    @property
    def shape(self) -> tf.TensorShape:
        return self.whole_shape

    @property
    def name(self) -> str:
        return self.shard.name

    @property
    def trainable(self) -> bool:
        return self.shard.trainable

    @property
    def synchronization(self) -> tf.VariableSynchronization:
        return self.shard.synchronization

    @property
    def aggregation(self) -> tf.VariableAggregation:
        return self.shard.aggregation

    @property
    def device(self) -> str:
        return self.shard.device

    @property
    def handle(self) -> tf.Tensor:
        # What `tf.GradientTape.gradient` differentiates with respect to: the slice. The
        # gradient it returns for the Keras variable is then this rank's slice.
        return self.shard.handle

    @property
    def _unique_id(self) -> str:
        return f"{self.shard._unique_id}_sharded"

    @property
    def _shared_name(self) -> str:
        return self.shard._shared_name

    def read_value(self) -> tf.Tensor:
        """The whole value (a collective: every rank reads it, in the same order)."""
        return self._gathered()

    def value(self) -> tf.Tensor:
        return self._gathered()

    def numpy(self) -> np.ndarray:
        """The whole value: the one saved at the end of the last fit while no step has run
        since (no collective: the chief saves the model alone), else a gather."""
        if (self.saved is not None and self.version is not None
                and self.saved[0] == self.version()):
            return self.saved[1]
        return self._gathered().numpy()

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return np.asarray(self.numpy(), dtype=dtype)

    def assign(self, value: Any, use_locking: bool = False, name: str | None = None,
               read_value: bool = True) -> Any:
        """Stores this rank's slice of the whole `value` (every rank assigns the same)."""
        self.saved = None
        self.shard.assign(self.slice_of(value))
        return value

    def slice_of(self, value: Any) -> tf.Tensor:
        """This rank's slice of a whole value, padded with zeros to `width`."""
        flat = tf.reshape(tf.cast(tf.convert_to_tensor(value), self.dtype), [-1])
        start = min(self._collectives.rank * self.width, self.size)
        stop = min(start + self.width, self.size)
        return tf.pad(flat[start:stop], [[0, self.width - (stop - start)]])

    def _gathered(self) -> tf.Tensor:
        collectives, index = self._collectives, self._index
        size, width, shape = self.size, self.width, self.whole_shape

        @tf.custom_gradient
        def whole(piece: tf.Tensor) -> Any:
            gathered = collectives.gather(piece, name=f"tfdist_zero3_weight_{index}")

            def gradient(upstream: Any) -> tf.Tensor:
                # A sparse gradient (an Embedding's rows) is summed into a dense one here:
                # repeated rows add exactly, as one device's update adds them.
                flat = tf.reshape(tf.convert_to_tensor(upstream), [-1])
                padded = tf.pad(flat, [[0, width * collectives.size - size]])
                return collectives.reduce_scatter(padded, name=f"tfdist_zero3_gradient_{index}")

            return tf.reshape(gathered[:size], shape), gradient

        return whole(self.shard.read_value())

    # --- checkpoints: each rank's slices are in its shard file (`tfdist.resume`) ---------

    def _serialize_to_tensors(self) -> dict[str, Any]:
        # The chief's checkpoint holds the chief's slice; every rank's own slice is in its
        # shard file, which a resume reads whatever the number of ranks.
        return self.shard._serialize_to_tensors()

    def _restore_from_tensors(self, restored_tensors: dict[str, Any]) -> Any:
        value = restored_tensors["VARIABLE_VALUE"]
        if value.shape == self.whole_shape:
            # The whole weight (a checkpoint of zero_stage 1 or 2): this rank's slice of it.
            return self.shard.assign(self.slice_of(value))
        # A slice (a checkpoint of zero_stage 3): the shard files restore this rank's.
        return tf.no_op()

    def __repr__(self) -> str:
        return (f"<ShardedWeight {self.name} shape={self.whole_shape} slice={self.width} of "
                f"{self._collectives.size} ranks>")


def _converted(weight: ShardedWeight, dtype: Any = None, name: str | None = None,
               as_ref: bool = False) -> tf.Tensor:
    del name, as_ref
    value = weight.read_value()
    return value if dtype is None or tf.as_dtype(dtype) == value.dtype else tf.cast(value, dtype)


tf.register_tensor_conversion_function(ShardedWeight, _converted)


# Names each sharded variable's collectives: every rank creates the same variables in the
# same order, so the k-th is the k-th on every rank.
_creation_order = itertools.count()


def is_sharded(variable: Any) -> bool:
    """Whether a Keras variable (or what it holds) is stored sharded (zero_stage 3)."""
    return isinstance(getattr(variable, "_value", variable), ShardedWeight)


def gradient_shape(variable: Any) -> tf.TensorShape:
    """The shape of `variable`'s gradient in the train step: its stored slice's at
    zero_stage 3 (the backward pass reduce-scatters it), else its own."""
    return variable._value.shard.shape if is_sharded(variable) else variable.shape


@contextlib.contextmanager
def sharded_creation(collectives: ShardCollectives) -> Iterator[None]:
    """Trainable variables created inside are stored as this rank's slice (`ShardedWeight`).

    Every rank must create the same variables in the same order (as data-parallel ranks
    building the same model do): each creation broadcasts rank 0's initial value.
    Non-trainable variables (BatchNormalization's statistics, metrics, optimizer state)
    are created as they would be.

    Args:
        collectives: The ranks' communicator.

    Example:

        with sharded_creation(collectives):
            model = build_model()
    """
    def creator(next_creator: Callable[..., Any], **kwargs: Any) -> Any:
        synchronization = kwargs.get("synchronization")
        if not kwargs.get("trainable", True) or synchronization in (
                tf.VariableSynchronization.ON_READ,):
            return next_creator(**kwargs)
        initial = kwargs["initial_value"]
        with tf.init_scope():
            value = tf.convert_to_tensor(initial() if callable(initial) else initial,
                                         dtype=kwargs.get("dtype"))
            index = next(_creation_order)
            value = collectives.broadcast(value, name=f"tfdist_zero3_initial_{index}")
            width = max(1, math.ceil(value.shape.num_elements() / collectives.size))
            flat = tf.reshape(value, [-1])
            start = min(collectives.rank * width, int(flat.shape[0]))
            stop = min(start + width, int(flat.shape[0]))
            piece = tf.pad(flat[start:stop], [[0, width - (stop - start)]])
            shape = value.shape
            del value, flat  # Only this rank's slice outlives the creation.
        arguments = {**kwargs, "initial_value": piece, "shape": None}
        return ShardedWeight(next_creator(**arguments), shape, collectives, index)

    with tf.variable_creator_scope(creator):
        yield
