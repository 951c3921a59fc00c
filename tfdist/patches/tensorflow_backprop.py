"""Patch to TensorFlow's `GradientTape.gradient` for sharded variables.

With a variable partitioner, ParameterServerStrategy gives a large Keras variable a
`ShardedVariable`: one TensorFlow variable per shard, on different servers.
TensorFlow differentiates with respect to variable handles, and a ShardedVariable
has one per shard and no `handle` of its own, so Keras 3's `train_step`
(`tape.gradient(loss, model.trainable_weights)`) fails: `AttributeError:
'ShardedVariable' object has no attribute 'handle'`. TensorFlow's design asks the
caller to differentiate with respect to `sharded.variables` (tensorflow/community#291);
Keras 3 dropped parameter-server training (keras-team/keras#18624) and never does.

The replacement acts only when a source holds a ShardedVariable: it asks the tape
for each shard's gradient and joins them in row order (dense gradients
concatenated, sparse ones from embedding lookups as one `IndexedSlices`). Every
other call is TensorFlow's own.

Example:

    from tfdist.patches import tensorflow_backprop

    tensorflow_backprop.SHARDED_VARIABLE_GRADIENTS.apply()
"""

from __future__ import annotations

from typing import Any, Callable

from tfdist.patches.base import Patch


def _tape_class() -> Any:
    import tensorflow as tf

    return tf.GradientTape


def shards_of(source: Any) -> list[Any] | None:
    """The shard variables behind a Keras variable or a ShardedVariable, else None."""
    from keras.src.backend.tensorflow import core
    from tensorflow.python.distribute import sharded_variable

    value = getattr(source, "_value", None) if isinstance(source, core.Variable) else source
    return list(value.variables) if isinstance(value, sharded_variable.ShardedVariable) \
        else None


def _join_shard_gradients(gradients: list[Any], shards: list[Any]) -> Any:
    """One gradient for the whole variable from its shards' gradients (rows in order)."""
    import tensorflow as tf

    if all(gradient is None for gradient in gradients):
        return None
    if all(isinstance(gradient, tf.IndexedSlices) or gradient is None for gradient in gradients):
        offset, values, indices = 0, [], []
        for gradient, shard in zip(gradients, shards):
            if gradient is not None:
                values.append(gradient.values)
                indices.append(tf.cast(gradient.indices, tf.int64) + offset)
            offset += shard.shape[0]
        return tf.IndexedSlices(tf.concat(values, 0), tf.concat(indices, 0),
                                dense_shape=[offset, *shards[0].shape[1:]])
    return tf.concat([tf.zeros(shard.shape, shard.dtype) if gradient is None
                      else tf.convert_to_tensor(gradient)
                      for gradient, shard in zip(gradients, shards)], axis=0)


def _per_shard(original: Callable) -> Callable:
    import tensorflow as tf

    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=tf.UnconnectedGradients.NONE):
        flat_sources = tf.nest.flatten(sources)
        shards = [shards_of(source) for source in flat_sources]
        if not any(shards):
            return original(self, target, sources, output_gradients, unconnected_gradients)
        expanded = [parts if parts else [source] for source, parts in zip(flat_sources, shards)]
        gradients = original(self, target, expanded, output_gradients, unconnected_gradients)
        joined = [_join_shard_gradients(part_gradients, parts) if parts else part_gradients[0]
                  for part_gradients, parts in zip(gradients, shards)]
        return tf.nest.pack_sequence_as(sources, joined)

    return gradient


def _sharded_variables_have_no_handle(original: Callable) -> bool:
    from tensorflow.python.distribute import sharded_variable

    return not hasattr(sharded_variable.ShardedVariable, "handle")


SHARDED_VARIABLE_GRADIENTS = Patch(
    "tensorflow.backprop.sharded_variable_gradients",
    owner=_tape_class, attribute="gradient", replacement=_per_shard,
    bug_present=_sharded_variables_have_no_handle,
    upstream="keras-team/keras#18624; TensorFlow differentiates per shard "
             "(tensorflow/community#291)",
    summary="tape.gradient of a Keras variable holding a ShardedVariable fails: "
            "'ShardedVariable' object has no attribute 'handle'")
