"""Patches to `horovod.tensorflow` for Keras 3 variables (horovod/horovod#4290).

A Keras 3 variable wraps a `tf.Variable` and is not one: it has no `ref()` and no
`device`. Horovod 0.28.1's `broadcast_variables` and `DistributedGradientTape` read
both, so `hvd.broadcast_variables(model.variables, 0)` and
`hvd.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)` fail
on Keras 3 with AttributeError. The fix upstream (horovod#4317) was withdrawn, and
Horovod has had no release since.

Each replacement hands Horovod the `tf.Variable` under each Keras variable (the
same storage: an assignment or a gradient reaches the Keras variable) and passes
everything else through unchanged.

Example:

    from tfdist.patches import horovod_tensorflow

    horovod_tensorflow.BROADCAST_VARIABLES.apply()
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from tfdist.patches.base import Patch, source_contains

UPSTREAM = "horovod/horovod#4290 (the fix, horovod#4317, was withdrawn)"


def _horovod_tensorflow() -> Any:
    import horovod.tensorflow

    return horovod.tensorflow


def _gradient_tape_class() -> Any:
    # `hvd.DistributedGradientTape(tape)` copies this class's methods into the class
    # it builds, when it is called: tapes made after the patch carry the fix.
    return _horovod_tensorflow()._DistributedGradientTape


def unwrapped(values: Any) -> Any:
    """`values` (one variable or a sequence) with each Keras variable's `tf.Variable` in
    its place."""
    import keras

    def one(value: Any) -> Any:
        return value.value if isinstance(value, keras.Variable) else value

    if isinstance(values, (list, tuple)):
        return type(values)(one(value) for value in values)
    return one(values)


def _unwrapping(position: int, keyword: str) -> Callable[[Callable], Callable]:
    """A replacement that unwraps the argument at `position` (or named `keyword`)."""
    def replacement(original: Callable) -> Callable:
        @functools.wraps(original)
        def call(*args: Any, **kwargs: Any) -> Any:
            if keyword in kwargs:
                kwargs[keyword] = unwrapped(kwargs[keyword])
            elif len(args) > position:
                args = (*args[:position], unwrapped(args[position]), *args[position + 1:])
            return original(*args, **kwargs)

        return call

    return replacement


def _knows_no_keras_variables(original: Any) -> bool:
    return not source_contains(original, "keras")


BROADCAST_VARIABLES = Patch(
    "horovod.tensorflow.broadcast_variables_keras_variables",
    owner=_horovod_tensorflow, attribute="broadcast_variables",
    replacement=_unwrapping(0, "variables"), bug_present=_knows_no_keras_variables,
    upstream=UPSTREAM,
    summary="hvd.broadcast_variables(model.variables, 0) fails: Keras 3 variables have no "
            "device or ref()")

TAPE_GRADIENT, TAPE_LOCAL_SOURCE, TAPE_LOCAL_AND_GLOBAL_GRADIENTS = (
    Patch(f"horovod.tensorflow.gradient_tape_{name}_keras_variables",
          owner=_gradient_tape_class, attribute=attribute,
          replacement=_unwrapping(position, keyword),
          bug_present=lambda original: (source_contains(original, ".ref()")
                                        and _knows_no_keras_variables(original)),
          upstream=UPSTREAM,
          summary=f"DistributedGradientTape.{attribute} fails on Keras 3 variables "
                  f"(no ref())")
    for name, attribute, position, keyword in (
        ("gradient", "gradient", 2, "sources"),
        ("local_source", "register_local_source", 1, "source"),
        ("local_and_global_gradients", "get_local_and_global_gradients", 2, "sources")))
