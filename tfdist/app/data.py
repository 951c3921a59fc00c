"""The main job's data: real handwritten digits, and synthetic features for benchmarks.

Both return unbatched `tf.data.Dataset`s, ready for `runner.dataset`.

Example:

    splits = digits()
    splits.num_features, splits.num_classes   # (64, 10)
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import tensorflow as tf

from tfdist.config import DatasetName, TrainConfig


@dataclasses.dataclass(frozen=True)
class DatasetSplits:
    """Unbatched train and test datasets and their shapes.

    Args:
        train, test: Datasets of (features float32, label int32) pairs.
        num_features, num_classes: Input width and label count.
        num_train, num_test: Examples in each split.
    """

    train: tf.data.Dataset
    test: tf.data.Dataset
    num_features: int
    num_classes: int
    num_train: int
    num_test: int


def digits(test_fraction: float = 0.2) -> DatasetSplits:
    """1,797 8x8 handwritten digits that ship with tfdist; needs no network.

    The test set of the UCI "Optical Recognition of Handwritten Digits" data
    (E. Alpaydin, C. Kaynak, 1998; CC BY 4.0), as scikit-learn bundles it
    (`digits.csv.gz`: 64 pixel counts 0..16, then the label, per line). It is kept
    here rather than read through scikit-learn because Keras imports scikit-learn
    whenever it is installed, which costs every process about a second.

    The split is fixed (the same permutation on every run and every process), so
    runs under different strategies see the same examples.

    Args:
        test_fraction: Share of examples held out for evaluation.
    """
    table = np.loadtxt(os.path.join(os.path.dirname(__file__), "digits.csv.gz"),
                       delimiter=",", dtype=np.int32)
    features = (table[:, :-1] / 16.0).astype(np.float32)
    labels = table[:, -1]
    return _split(features, labels, 10, test_fraction)


def synthetic(num_examples: int, num_features: int, num_classes: int = 10,
              seed: int = 0, test_fraction: float = 0.2) -> DatasetSplits:
    """Gaussian features labelled by a fixed random linear map: learnable, any size.

    Args:
        num_examples: Training examples (the test split is added on top).
        num_features: Features per example.
        num_classes: Label count.
        seed: Makes the data identical across processes.
        test_fraction: Test examples as a share of the training examples.
    """
    rng = np.random.default_rng(seed)
    total = num_examples + max(1, int(num_examples * test_fraction))
    features = rng.standard_normal((total, num_features), dtype=np.float32)
    projection = rng.standard_normal((num_features, num_classes), dtype=np.float32)
    labels = np.argmax(features @ projection, axis=1).astype(np.int32)
    return _split(features, labels, num_classes, (total - num_examples) / total)


def load(train: TrainConfig) -> DatasetSplits:
    """The dataset the main job's config names."""
    if train.dataset is DatasetName.SYNTHETIC:
        return synthetic(train.synthetic_examples, train.synthetic_features)
    return digits()


def _split(features: np.ndarray, labels: np.ndarray, num_classes: int,
           test_fraction: float) -> DatasetSplits:
    order = np.random.RandomState(0).permutation(len(features))
    num_test = int(round(len(features) * test_fraction))
    test, train = order[:num_test], order[num_test:]
    return DatasetSplits(
        train=tf.data.Dataset.from_tensor_slices((features[train], labels[train])),
        test=tf.data.Dataset.from_tensor_slices((features[test], labels[test])),
        num_features=features.shape[1], num_classes=num_classes,
        num_train=len(train), num_test=num_test)
