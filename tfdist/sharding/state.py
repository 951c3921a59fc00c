"""The whole optimizer state as plain Keras lays it out, and the bytes a process holds.

A sharded optimizer saves (`model.save`) and gathers its state in the order the
unsharded optimizer of the same class lists its variables; `plain_order` finds that
order by building the class on one-element stand-ins, so it holds for any optimizer
whose per-variable slots are made with `add_variable_from_reference`.

Example:

    plain_order(keras.optimizers.Adam, Adam().get_config(), count=2)
    # [("other", 0), ("other", 1), ("slot", 0, "momentum"), ("slot", 0, "velocity"), ...]
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import tensorflow as tf


def plain_order(base: type, config: dict[str, Any], count: int) -> list[tuple[Any, ...]]:
    """What `base` (with `config`), built unsharded on `count` variables, lists in
    `variables`, in order: ("slot", variable index, slot name) for a per-variable slot,
    ("other", k) for its k-th other variable (the step, the learning rate).

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
            order.append(("slot", *made[id(variable)]))
        else:
            order.append(("other", others))
            others += 1
    return order


def state_bytes(optimizer: Any) -> int:
    """Bytes of the state `optimizer` holds in this process (`optimizer.variables`).

    Example:

        state_bytes(model.optimizer)   # under zero_stage 2: about 1/N of zero_stage 0's
    """
    return sum(int(np.prod(v.shape)) * np.dtype(keras.backend.standardize_dtype(v.dtype)).itemsize
               for v in optimizer.variables)
