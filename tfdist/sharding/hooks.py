"""Where ZeRO's storage meets Keras: the one module that reads or replaces what a Keras
variable holds.

A Keras 3 variable keeps its backend value in a private attribute, `_value` (under
TensorFlow, a `tf.Variable`): every read, assign and gradient of the variable goes
through it. ZeRO puts its own storage there: at stage 2 a `ReduceScatteredWeight` (the
sharded optimizer's build), at stage 3 a `ShardedWeight` (Keras itself stores what
`sharded_creation`'s variable creator returns). Everything else in tfdist asks this
module what a variable holds, and replaces it only here, with an undo. The member is
declared in `tfdist.sharding.private`, which checks it against the installed Keras; a
layout rule (tests/test_layout.py) keeps `_value` out of every other module but
tfdist's patches of Keras itself.

Example:

    undo = replace_storage(variable, ReduceScatteredWeight(held(variable), collectives, 0))
    held(variable)          # the ReduceScatteredWeight: reads of it now reduce-scatter
    undo()                  # the variable holds its tf.Variable again
"""

from __future__ import annotations

from typing import Any, Callable


def held(variable: Any) -> Any:
    """What a Keras variable holds (its `tf.Variable`, or ZeRO's storage in its place);
    any other value (a `tf.Variable`, ZeRO's storage itself) as it is."""
    return getattr(variable, "_value", variable)


def replace_storage(variable: Any, value: Any) -> Callable[[], None]:
    """Makes the Keras `variable` hold `value` in place of what it holds now.

    Args:
        variable: A Keras variable.
        value: What it reads, assigns and differentiates through from now on: ZeRO's
            storage (`tfdist.sharding.weights`), or a `tf.Variable`.

    Returns:
        The undo: a call that makes the variable hold again what it held before.

    Example:

        undo = replace_storage(variable, weight)
        undo()
    """
    previous = variable._value
    variable._value = value

    def undo() -> None:
        variable._value = previous

    return undo
