"""The small classifier and its data that `overhead.py` and `checkpoint.py` time.

One definition, so the two benchmarks' step times are of the same model: a 256-feature,
10-class MLP (two hidden layers of 512) on standard-normal features, batches of 256.

    from workloads import BATCH, classifier, examples

    model = classifier(dropout=0.1)
    dataset = examples(steps=20).batch(BATCH)
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

FEATURES, CLASSES, BATCH = 256, 10, 256


def classifier(dropout: float = 0.0) -> keras.Model:
    """The MLP, unbuilt weights and all.

    Args:
        dropout: A Dropout layer's rate after the first hidden layer (none at 0): a layer
            whose random state a checkpoint keeps.
    """
    return keras.Sequential([
        keras.Input((FEATURES,)),
        keras.layers.Dense(512, activation="relu"),
        *([keras.layers.Dropout(dropout)] if dropout else []),
        keras.layers.Dense(512, activation="relu"),
        keras.layers.Dense(CLASSES, activation="softmax"),
    ])


def examples(steps: int) -> tf.data.Dataset:
    """`steps` batches' worth of seeded examples (features, integer labels), unbatched."""
    rng = np.random.default_rng(0)
    count = steps * BATCH
    return tf.data.Dataset.from_tensor_slices(
        (rng.standard_normal((count, FEATURES), dtype=np.float32),
         rng.integers(0, CLASSES, count).astype(np.int32)))
