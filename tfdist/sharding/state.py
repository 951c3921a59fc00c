"""The whole optimizer state as plain Keras lays it out, and the bytes a process holds.

A sharded optimizer saves (`model.save`) and gathers its state in the order the
unsharded optimizer of the same class lists its variables; `plain_order` finds that
order by building the class on one-element stand-ins, so it holds for any optimizer
whose per-variable slots are made with `add_variable_from_reference`.

Example:

    plain_order(keras.optimizers.Adam, Adam().get_config(), count=2)
    # [Other(0), Other(1), Slot(0, "momentum"), Slot(0, "velocity"), Slot(1, "momentum"), ...]
"""

from __future__ import annotations

from typing import Any, NamedTuple

import keras
import numpy as np
import tensorflow as tf


class Slot(NamedTuple):
    """A per-variable slot of an optimizer's state: Adam's `momentum` of variable 3."""

    variable: int  # The variable's index in the optimizer's list.
    name: str  # The slot's name (`momentum`, `velocity`).


class Other(NamedTuple):
    """An optimizer variable that belongs to no model variable (the step, the rate)."""

    index: int  # Its place among such variables, in the optimizer's order.


class ShardPart(NamedTuple):
    """Part of one slot that one rank holds: elements [start, stop) of the flattened slot
    `slot` of variable `variable`, and their values. A rank's shard file is a list of them."""

    variable: int
    slot: str
    start: int
    stop: int
    values: np.ndarray


def plain_order(base: type, config: dict[str, Any], count: int) -> list[Slot | Other]:
    """What `base` (with `config`), built unsharded on `count` variables, lists in
    `variables`, in order: a `Slot` for each per-variable slot, an `Other` for each other
    variable (the step, the learning rate).

    Args:
        base: A Keras optimizer class.
        config: Its config (`get_config()`): EMA and amsgrad, say, add slots.
        count: How many trainable variables the real optimizer is built on.
    """
    made: dict[int, tuple[int, str]] = {}
    stand_ins: list[Any] = []

    class Recording(base):  # type: ignore[misc, valid-type]
        def add_variable_from_reference(self, reference_variable, name=None,
                                        initializer="zeros"):
            variable = super().add_variable_from_reference(reference_variable, name=name,
                                                           initializer=initializer)
            index = next(i for i, v in enumerate(stand_ins) if v is reference_variable)
            made[id(variable)] = (index, name or "var")
            return variable

    with tf.init_scope():
        # One element each: the order, not the sizes, is what is asked.
        stand_ins.extend(keras.Variable(np.zeros((1,), "float32")) for _ in range(count))
        plain = Recording.from_config(config)
        plain.build(stand_ins)
    order, others = [], 0
    for variable in plain.variables:
        if id(variable) in made:
            order.append(Slot(*made[id(variable)]))
        else:
            order.append(Other(others))
            others += 1
    return order


def state_bytes(optimizer: Any) -> int:
    """Bytes of the state `optimizer` holds in this process (`optimizer.variables`).

    Example:

        state_bytes(model.optimizer)   # under zero_stage 2: about 1/N of zero_stage 0's
    """
    return sum(int(np.prod(v.shape)) * np.dtype(keras.backend.standardize_dtype(v.dtype)).itemsize
               for v in optimizer.variables)
