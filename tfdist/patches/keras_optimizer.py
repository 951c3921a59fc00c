"""Patch to Keras 3's TensorFlow optimizer (`keras/src/backend/tensorflow/optimizer.py`).

The optimizer creates each slot variable (Adam's moments) colocated with the variable
it belongs to. A ShardedVariable under ParameterServerStrategy cannot be a colocation
reference ("ShardedVariable doesn't support being used as a reference"), so the
optimizer fails on its first step (keras-team/keras#18624 left parameter-server
training unsupported). The replacement creates the slots of a sharded variable without
colocation, and the strategy's partitioner shards them like the variable; every other
variable's slots are Keras's own.

Example:

    from tfdist.patches import keras_optimizer

    keras_optimizer.SHARDED_SLOT_VARIABLES.apply()
"""

from __future__ import annotations

from typing import Any, Callable

from tfdist.patches.base import Patch, source_contains
from tfdist.patches.tensorflow_backprop import shards_of


def _optimizer_class() -> Any:
    from keras.src.backend.tensorflow import optimizer

    return optimizer.TFOptimizer


def _uncolocated_for_shards(original: Callable) -> Callable:
    from keras.src.optimizers import base_optimizer

    def add_variable_from_reference(self, reference_variable, name=None, initializer="zeros"):
        if shards_of(reference_variable) is None:
            return original(self, reference_variable, name=name, initializer=initializer)
        return base_optimizer.BaseOptimizer.add_variable_from_reference(
            self, reference_variable, name=name, initializer=initializer)

    return add_variable_from_reference


SHARDED_SLOT_VARIABLES = Patch(
    "keras.optimizer.sharded_slot_variables",
    owner=_optimizer_class, attribute="add_variable_from_reference",
    replacement=_uncolocated_for_shards,
    bug_present=lambda original: source_contains(original, "colocate_vars_with"),
    upstream="keras-team/keras#18624 (parameter-server training left unsupported)",
    summary="the optimizer cannot create slots for a ShardedVariable: 'ShardedVariable "
            "doesn't support being used as a reference'")
