"""What `runner.dataset` refuses before training: data that would give no step, or wrong ones.

`runner.dataset` batches unbatched examples to the global batch. Two mistakes then
reach `model.fit` as a bare `StopIteration`, or as a shape error deep in Keras:

- a dataset batched already (`ds.batch(32)` passed in): its batches are batched again;
- fewer examples than one global batch, with `drop_remainder` (the default): no step.

Both are told here in one line, and so is a batch a pipeline's micro-batches do not divide
(`model_parallel.micro_batches`). A batching operation is recognised by tf.data's own
dataset classes (`.batch()`, `.padded_batch()`, `.ragged_batch()`, `.sparse_batch()`,
`.rebatch()`), found by walking the pipeline back from its end; an `.unbatch()` on the
way back means the examples are unbatched again. A class this walk does not know is
passed over, so an unknown pipeline is let through rather than refused.

Example:

    check_source(tf.data.Dataset.range(10).batch(2), global_batch_size=4)  # ConfigError
"""

from __future__ import annotations

from typing import Any

from tfdist.errors import ConfigError

# tf.data's dataset classes (TensorFlow 2.21) that batch, and what the user called.
_BATCHING = {
    "_BatchDataset": ".batch()",
    "_ParallelBatchDataset": ".batch(num_parallel_calls=...)",
    "_PaddedBatchDataset": ".padded_batch()",
    "_DenseToSparseBatchDataset": ".sparse_batch()",
    "_RebatchDataset": ".rebatch()",
}
_UNBATCHING = {"_UnbatchDataset"}


def check_source(source: Any, global_batch_size: int, drop_remainder: bool = True) -> None:
    """Refuses a `tf.data.Dataset` that is batched already or holds less than one batch.

    Args:
        source: What was passed to `runner.dataset`; anything but a `tf.data.Dataset`
            (a function of the input context) is not checked.
        global_batch_size: Examples per step across all replicas.
        drop_remainder: Whether a last partial batch is dropped.

    Raises:
        ConfigError: one line saying which and what to do.
    """
    import tensorflow as tf

    if not isinstance(source, tf.data.Dataset):
        return
    batching = _batching_call(source)
    if batching is not None:
        raise ConfigError(
            f"runner.dataset takes unbatched examples and batches them to global_batch_size "
            f"itself, but this dataset is batched already (its {batching}); remove that call "
            f"(or add .unbatch()). Received: a dataset whose elements are "
            f"{_spec_text(source.element_spec)}")
    count = int(source.cardinality())
    if drop_remainder and 0 <= count < global_batch_size:
        raise ConfigError(
            f"the data holds {count} examples, fewer than one global batch of "
            f"{global_batch_size}, so no step would run; use a global_batch_size of at most "
            f"{count} (or more data). Received: global_batch_size={global_batch_size}")


def check_micro_batches(global_batch_size: int, num_replicas: int, micro_batches: int) -> None:
    """Refuses a batch whose replica's share `micro_batches` does not divide: a `Pipeline`
    cuts each replica's batch into that many equal parts.

    Args:
        global_batch_size: The batch of one step across all replicas.
        num_replicas: Replicas the batch is split across.
        micro_batches: `model_parallel.micro_batches`.

    Example:

        check_micro_batches(64, num_replicas=2, micro_batches=4)   # 32 per replica: fine
        check_micro_batches(60, num_replicas=2, micro_batches=4)   # ConfigError
    """
    per_replica = global_batch_size // max(1, num_replicas)
    if micro_batches > 1 and per_replica % micro_batches:
        raise ConfigError(f"model_parallel.micro_batches={micro_batches} must divide each "
                          f"replica's batch of {per_replica} examples (global batch "
                          f"{global_batch_size} over {num_replicas} replicas); use a "
                          f"batch that is a multiple of {micro_batches * num_replicas}. "
                          f"Received: global_batch_size={global_batch_size}, "
                          f"model_parallel.micro_batches={micro_batches}")


def _batching_call(dataset: Any) -> str | None:
    """The batching call nearest the pipeline's end with no unbatch after it, or None."""
    pending, seen = [dataset], set()
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        name = type(current).__name__
        if name in _BATCHING:
            return _BATCHING[name]
        if name in _UNBATCHING:
            continue
        try:
            pending.extend(current._inputs())
        except (AttributeError, NotImplementedError):  # not a tf.data class we can read
            continue
    return None


def _spec_text(spec: Any) -> str:
    import tensorflow as tf

    shapes = tf.nest.map_structure(lambda component: tuple(component.shape), spec)
    return str(shapes).replace("None", "?")
