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

import contextlib
from typing import Any, Callable, ContextManager, Iterator


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


def wrap_call(layer: Any, wrapper: Callable[..., Any]) -> Callable[[], None]:
    """Makes each call of `layer` go through `wrapper(call, *args, **kwargs)`, where
    `call` is the layer's own.

    Keras's `Layer.__call__` calls `self.call`: an attribute on the instance takes the
    place of the class's method for this layer alone, after Keras has read the method's
    signature (its `training` and `mask` arguments).

    Args:
        layer: A Keras layer.
        wrapper: Called in place of the layer's `call`, with the layer's own first.

    Returns:
        The undo: the layer calls its own `call` again.

    Example:

        undo = wrap_call(layer, lambda call, *args, **kwargs: call(*args, **kwargs))
        undo()
    """
    own = layer.call
    had_instance_call = "call" in vars(layer)

    def call(*args: Any, **kwargs: Any) -> Any:
        return wrapper(own, *args, **kwargs)

    layer.call = call

    def undo() -> None:
        if had_instance_call:
            layer.call = own
        else:
            del layer.call

    return undo


def layers_creating_variables() -> list[Any]:
    """The Keras layers whose `add_weight`, `build` or call is running now, outermost
    first; the last one owns a variable created now. Empty where none is, or where the
    innermost owner is another object (an optimizer, whose variables belong to no layer).

    Keras enters `keras.name_scope(layer.name, caller=layer)` around a layer's build and
    call; the scopes' callers are the layers being built or called, one inside the other.

    Example:

        layers_creating_variables()   # [<Block>, <Dense>] inside a Block's Dense's build
    """
    import keras
    from keras.src.backend.common import global_state

    stack = global_state.get_global_attribute("name_scope_stack") or []
    callers = [scope.caller for scope in stack if getattr(scope, "caller", None) is not None]
    if not callers or not isinstance(callers[-1], keras.layers.Layer):
        return []
    return [caller for caller in callers if isinstance(caller, keras.layers.Layer)]


def layer_creating_variables() -> Any:
    """The Keras layer whose `add_weight` (or `build`) is running now, or None: the last of
    `layers_creating_variables()`."""
    layers = layers_creating_variables()
    return layers[-1] if layers else None


def own_weights(root: Any) -> Iterator[tuple[Any, list[Any]]]:
    """Each layer under `root` (a layer or model: itself, then its layers, depth first)
    with the trainable variables it created itself, not its inner layers'.

    Example:

        for layer, weights in own_weights(model):
            print(layer.name, [w.path for w in weights])
    """
    for layer in layers_under(root):
        yield layer, list(layer._trainable_variables)


def layers_under(root: Any) -> list[Any]:
    """`root` (a layer or model) and every layer inside it, depth first."""
    return list(root._flatten_layers(include_self=True, recursive=True))


def autocast_dtype(layer: Any) -> Any:
    """The dtype the call of `layer` running now reads each of its own float32 trainable
    weights in: Keras's autocast scope's (a mixed policy's compute dtype, `float16` or
    `bfloat16`) where every one of them autocasts; else None (they read as float32).

    Keras's `Layer.__call__` enters the scope around `call` when the layer's compute dtype
    differs from its variables' dtype; a variable made with `autocast=False` is read
    uncast. Call it inside the layer's `call`.

    Example:

        dtype = autocast_dtype(layer)   # "float16" in a Dense under mixed_float16
    """
    from keras.src.backend.common import global_state

    scope = global_state.get_global_attribute("autocast_scope")
    weights = list(layer._trainable_variables)
    # (Inside the scope a Keras variable's `dtype` is the scope's: the layer's policy says
    # what the weights are stored in.)
    if (scope is None or scope.dtype is None or layer.variable_dtype != "float32"
            or not weights or not all(weight._autocast for weight in weights)):
        return None
    return scope.dtype


# What Keras's `Layer.__call__` sets around a layer's `call`, in Keras's global state: the
# dtype its variables are read in (a mixed policy's compute dtype), and the call's context
# (the `training` flag its inner layers inherit).
_CALL_STATE = ("autocast_scope", "current_call_ctx")


def keras_call_state() -> Callable[[], ContextManager[None]]:
    """What Keras set up around the layer call running now, to re-enter around a
    recompute of that call outside it (in the backward pass).

    Returns:
        A function of no arguments giving a context manager: inside it, Keras's autocast
        scope and call context are the ones of now; after it, what they were before.

    Example:

        state = keras_call_state()      # inside a layer's call
        with state():                   # later, in the backward pass
            recomputed = call(*args, **kwargs)
    """
    from keras.src.backend.common import global_state

    saved = {name: global_state.get_global_attribute(name) for name in _CALL_STATE}

    @contextlib.contextmanager
    def restored() -> Iterator[None]:
        before = {name: global_state.get_global_attribute(name) for name in _CALL_STATE}
        for name, value in saved.items():
            global_state.set_global_attribute(name, value)
        try:
            yield
        finally:
            for name, value in before.items():
                global_state.set_global_attribute(name, value)

    return restored
