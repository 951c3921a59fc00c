"""Running part of a model on one device, its gradient included.

`tf.device` around a layer's build places its variables (and Keras's optimizer
slots, created beside them); around its call, the forward ops. The backward ops
are another matter: `tf.GradientTape` does not colocate a gradient with the op it
differentiates (tensorflow#33688; TensorFlow 1's `colocate_gradients_with_ops` has
no TF2 equivalent), so they would all land on the default device. `on_device` runs
a function under a device with a gradient of its own, computed under that device
too, from a tape recorded in the forward pass (nothing is recomputed).

The devices a model is spread over come from the Runner (`model_parallel.devices`):
inside `runner.scope()`, `current_devices()` lists them, and `tfdist.parallel`'s
layers default to them.

Example:

    with use_devices(["/device:CPU:0", "/device:CPU:1"]):
        current_devices()                              # both
    outputs = on_device("/device:CPU:1", dense, inputs)  # forward and backward there
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Sequence

import tensorflow as tf

from tfdist import patches
from tfdist.errors import ConfigError

_placements: list[tuple[tuple[str, ...], int]] = []


@contextlib.contextmanager
def use_devices(devices: Sequence[str], micro_batches: int = 1) -> Iterator[None]:
    """Within the block, `current_devices()` is `devices` and `current_micro_batches()`
    is `micro_batches` (the Runner enters this in `runner.scope()` when
    `model_parallel.devices` > 1)."""
    _placements.append((tuple(devices), micro_batches))
    try:
        yield
    finally:
        _placements.pop()


def current_devices() -> tuple[str, ...]:
    """The devices `use_devices` set, innermost first; () outside any."""
    return _placements[-1][0] if _placements else ()


def current_micro_batches() -> int:
    """The micro-batches `use_devices` set; 1 outside any."""
    return _placements[-1][1] if _placements else 1


def resolve_devices(devices: Sequence[str] | None, what: str) -> tuple[str, ...]:
    """`devices`, or the Runner's; refuses none at all. Every layer of `tfdist.parallel`
    asks here, so this is where their patches (`patches.MODEL_PARALLEL`) are applied,
    before the layer builds anything.

    Args:
        devices: Given by the user, or None.
        what: The layer asking, for the message.
    """
    found = tuple(devices) if devices is not None else current_devices()
    if not found:
        raise ConfigError(f"{what} needs the devices to spread the model over: build it inside "
                          f"runner.scope() with model_parallel.devices > 1, or pass devices=[...]. "
                          f"Received: no devices")
    patches.apply(patches.MODEL_PARALLEL)
    return found


def _is_differentiable(value: Any) -> bool:
    return value.dtype.is_floating or value.dtype.is_complex


def on_device(device: str, function: Callable[..., Any], *inputs: Any) -> Any:
    """`function(*inputs)` with its forward and backward ops on `device`.

    Args:
        device: A TensorFlow device name.
        function: Takes and returns tensors (a single tensor, or a flat list/tuple); the
            variables it reads get their gradients from it.
        *inputs: Tensors; integer ones (token ids) get no gradient.

    Returns:
        What `function` returns.
    """
    inputs = [tf.convert_to_tensor(value) for value in inputs]

    @tf.custom_gradient
    def run(*values):
        with tf.device(device), tf.GradientTape(watch_accessed_variables=True) as tape:
            for value in values:
                if _is_differentiable(value):
                    tape.watch(value)
            outputs = function(*values)

        def gradient(*output_gradients, variables=None):
            variables = list(variables or [])
            sources = [value for value in values if _is_differentiable(value)]
            with tf.device(device):
                found = tape.gradient(
                    outputs, sources + variables,
                    output_gradients=list(output_gradients) if isinstance(
                        outputs, (list, tuple)) else output_gradients[0],
                    unconnected_gradients=tf.UnconnectedGradients.ZERO)
            by_input = iter(found[:len(sources)])
            return ([next(by_input) if _is_differentiable(value) else None for value in values],
                    found[len(sources):])

        return outputs, gradient

    return run(*inputs)
