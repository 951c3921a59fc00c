"""Patches to Keras 3's TensorFlow `Variable` (`keras/src/backend/tensorflow/core.py`).

Keras 3 implements `assign_add` and `assign_sub` as a read followed by an assign
(`keras/src/backend/common/variables.py`). Under ParameterServerStrategy, workers
update the same variable on a parameter server at once, and two steps that read the
same value both write value + 1: increments are lost. `optimizer.iterations` read 19
after 20 scheduled steps with 2 workers, which shifts learning-rate schedules and
Adam's bias correction; loss and metric totals lose updates the same way. Keras 3
dropped parameter-server training (keras-team/keras#18624), and no Keras release has
atomic updates.

The replacement calls the TensorFlow variable's own `assign_add`/`assign_sub` (one
`AssignAddVariableOp`, applied under the variable's lock on its server), only for a
variable placed by a ParameterServerStrategy and never inside a Keras
`StatelessScope` (where Keras records the update instead of writing it).

Example:

    from tfdist.patches import keras_variables

    keras_variables.ATOMIC_ASSIGN_ADD.apply()
"""

from __future__ import annotations

from typing import Any, Callable

from tfdist.patches.base import Patch, source_contains


def _variable_class() -> Any:
    from keras.src.backend.tensorflow import core

    return core.Variable


def on_parameter_servers(value: Any) -> bool:
    """Whether a TensorFlow variable was created by a ParameterServerStrategy.

    Such variables are wrapped by the strategy (a `CachingVariable`, an
    `AggregatingVariable` with several GPUs per worker) or split into a
    `ShardedVariable`.
    """
    from tensorflow.python.distribute import ps_values, sharded_variable

    return isinstance(value, (ps_values.CachingVariable, ps_values.AggregatingVariable,
                              sharded_variable.ShardedVariable))


def _atomic(original: Callable) -> Callable:
    import tensorflow as tf
    from keras.src.backend.common.stateless_scope import in_stateless_scope

    name = original.__name__

    def update(self, value):
        if (in_stateless_scope() or isinstance(value, tf.IndexedSlices)
                or not on_parameter_servers(self._value)):
            return original(self, value)
        # Keras's `assign` casts to the variable's dtype first; so does this.
        return getattr(self._value, name)(tf.cast(value, self._value.dtype))

    update.__name__ = name
    return update


def _reads_then_writes(operator: str) -> Callable[[Any], bool]:
    return lambda original: source_contains(original, f"self.assign(self {operator} value)")


ATOMIC_ASSIGN_ADD, ATOMIC_ASSIGN_SUB = (
    Patch(f"keras.variables.atomic_{name}",
          owner=_variable_class, attribute=name, replacement=_atomic,
          bug_present=_reads_then_writes(operator),
          upstream="keras-team/keras#18624 (parameter-server training left unsupported)",
          summary=f"Variable.{name} is a read then a write: concurrent updates from "
                  f"parameter-server workers are lost")
    for name, operator in (("assign_add", "+"), ("assign_sub", "-")))
