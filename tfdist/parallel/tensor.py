"""Tensor parallelism: one Dense layer's matmul split over a process's devices.

Megatron-LM's pair for an MLP block: `ColumnParallelDense` splits the kernel's output
columns over the K devices (each computes its columns of the output, activation
included, from the whole input); `RowParallelDense` splits its kernel's input rows
the same way (each multiplies its part of the input by its rows), and the K partial
products are summed once: one reduction per pair, no gather in between. Each part's
forward and backward ops run on its device (`placement.on_device`).

`get_weights`/`set_weights` and `.keras` files take Dense's whole kernel and bias, so
a plain model's weights load into the parallel one, and back.

Example:

    with runner.scope():   # model_parallel.devices: 2
        model = keras.Sequential([keras.Input((64,)),
                                  ColumnParallelDense(256, activation="relu"),
                                  RowParallelDense(64)])
"""

from __future__ import annotations

from typing import Any, Sequence

import keras
import numpy as np
import tensorflow as tf

from tfdist.errors import ConfigError
from tfdist.parallel.placement import on_device, resolve_devices


class _WholeWeights:
    """Saved and loaded as `get_weights` gives them (the plain layer's whole kernels), so a
    `.keras` or weights file holds what the plain layer's would."""

    def save_own_variables(self, store: Any) -> None:
        for index, value in enumerate(self.get_weights()):
            store[str(index)] = value

    def load_own_variables(self, store: Any) -> None:
        self.set_weights([store[str(index)] for index in range(len(store.keys()))])


class _SplitDense(_WholeWeights, keras.layers.Layer):
    """What the pair shares: the devices, the split kernel, Dense's weight layout."""

    axis: int  # The kernel's axis split over the devices: 1 columns, 0 rows.

    def __init__(self, units: int, activation: Any = None, use_bias: bool = True,
                 kernel_initializer: Any = "glorot_uniform", bias_initializer: Any = "zeros",
                 devices: Sequence[str] | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        self.units = int(units)
        self.activation = keras.activations.get(activation)
        self.use_bias = use_bias
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)
        self.devices = resolve_devices(devices, type(self).__name__)

    def _make_kernels(self, shape: tuple[int, int]) -> None:
        # The whole kernel is drawn once, as Dense draws it, then cut: the same seed gives
        # the same weights as a plain Dense, whatever K.
        whole = self.kernel_initializer(shape, dtype=self.variable_dtype)
        parts = np.split(keras.ops.convert_to_numpy(whole), len(self.devices), axis=self.axis)
        self.kernels = []
        for index, (device, part) in enumerate(zip(self.devices, parts)):
            with tf.device(device):
                self.kernels.append(self.add_weight(
                    shape=part.shape, initializer=keras.initializers.Constant(part),
                    name=f"kernel_{index}"))

    def _check_divides(self, size: int, what: str) -> None:
        if size % len(self.devices):
            raise ConfigError(f"{type(self).__name__} splits its {what} over "
                              f"{len(self.devices)} devices, which must divide them. Received: "
                              f"{what}={size}, devices={len(self.devices)}")

    def get_weights(self) -> list[np.ndarray]:
        """Dense's: the whole kernel, then the bias."""
        kernel = np.concatenate([k.numpy() for k in self.kernels], axis=self.axis)
        return [kernel, *self._bias_values()]

    def set_weights(self, weights: Sequence[Any]) -> None:
        """Takes Dense's weights: the whole kernel, then the bias."""
        kernel, *bias = weights
        parts = np.split(np.asarray(kernel), len(self.devices), axis=self.axis)
        for variable, part in zip(self.kernels, parts):
            variable.assign(part)
        self._assign_bias(bias)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "units": self.units,
                "activation": keras.activations.serialize(self.activation),
                "use_bias": self.use_bias,
                "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
                "bias_initializer": keras.initializers.serialize(self.bias_initializer),
                "devices": list(self.devices)}


@keras.saving.register_keras_serializable(package="tfdist")
class ColumnParallelDense(_SplitDense):
    """A Dense layer whose output columns are split over the devices.

    Args:
        units: Output width (divisible by the number of devices).
        gather_output: Join the parts into one tensor (for a layer that is not a
            `RowParallelDense`); by default the K parts go on, each on its device.
        **kwargs: `activation`, `use_bias`, `kernel_initializer`, `bias_initializer` as
            `keras.layers.Dense`'s; `devices`, the device names (None: the Runner's,
            `model_parallel.devices`); a Keras layer's own (`name`, `dtype`).

    Example:

        hidden = ColumnParallelDense(256, activation="relu")(inputs)  # K parts
        outputs = RowParallelDense(64)(hidden)                         # one sum
    """

    axis = 1

    def __init__(self, units: int, gather_output: bool = False, **kwargs: Any):
        super().__init__(units, **kwargs)
        self.gather_output = gather_output
        self._check_divides(self.units, "units")

    def build(self, input_shape: Any) -> None:
        self._make_kernels((int(input_shape[-1]), self.units))
        self.biases = []
        if self.use_bias:
            for index, device in enumerate(self.devices):
                with tf.device(device):
                    self.biases.append(self.add_weight(
                        shape=(self.units // len(self.devices),),
                        initializer=self.bias_initializer, name=f"bias_{index}"))

    def call(self, inputs: Any) -> Any:
        parts = []
        for index, device in enumerate(self.devices):
            def part(values, index=index):
                values = tf.matmul(values, tf.cast(self.kernels[index], values.dtype))
                if self.use_bias:
                    values = values + tf.cast(self.biases[index], values.dtype)
                return self.activation(values)

            parts.append(on_device(device, part, inputs))
        return tf.concat(parts, axis=-1) if self.gather_output else parts

    def compute_output_spec(self, inputs: Any) -> Any:
        batch = inputs.shape[:-1]
        if self.gather_output:
            return keras.KerasTensor((*batch, self.units), dtype=self.compute_dtype)
        return [keras.KerasTensor((*batch, self.units // len(self.devices)),
                                  dtype=self.compute_dtype) for _ in self.devices]

    def _bias_values(self) -> list[np.ndarray]:
        return [np.concatenate([b.numpy() for b in self.biases])] if self.use_bias else []

    def _assign_bias(self, bias: Sequence[Any]) -> None:
        if self.use_bias:
            for variable, part in zip(self.biases, np.split(np.asarray(bias[0]),
                                                            len(self.devices))):
                variable.assign(part)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "gather_output": self.gather_output}


@keras.saving.register_keras_serializable(package="tfdist")
class RowParallelDense(_SplitDense):
    """A Dense layer whose input rows are split over the devices; the partial products
    are summed once, on the first device, where the bias and activation apply.

    Args:
        units: Output width.
        activation: As `keras.layers.Dense`'s.
        use_bias: As `keras.layers.Dense`'s.
        kernel_initializer: As `keras.layers.Dense`'s.
        bias_initializer: As `keras.layers.Dense`'s.
        devices: Device names. None: the Runner's (`model_parallel.devices`).

    Takes a `ColumnParallelDense`'s K parts, or one whole tensor (cut into K).

    Example:

        outputs = RowParallelDense(64)(ColumnParallelDense(256, activation="relu")(inputs))
    """

    axis = 0

    def build(self, input_shape: Any) -> None:
        if isinstance(input_shape, (list, tuple)) and input_shape and isinstance(
                input_shape[0], (list, tuple)):
            width = sum(int(shape[-1]) for shape in input_shape)
        else:
            width = int(input_shape[-1])
        self._check_divides(width, "input width")
        self._make_kernels((width, self.units))
        self.biases = []
        if self.use_bias:
            with tf.device(self.devices[0]):
                self.biases.append(self.add_weight(shape=(self.units,),
                                                   initializer=self.bias_initializer,
                                                   name="bias"))

    def call(self, inputs: Any) -> Any:
        if not isinstance(inputs, (list, tuple)):
            inputs = tf.split(inputs, len(self.devices), axis=-1)
        partials = [on_device(device, lambda values, index=index: tf.matmul(
                        values, tf.cast(self.kernels[index], values.dtype)), part)
                    for index, (device, part) in enumerate(zip(self.devices, inputs))]
        with tf.device(self.devices[0]):
            outputs = tf.add_n(partials)  # The pair's one reduction.
            if self.use_bias:
                outputs = outputs + tf.cast(self.biases[0], outputs.dtype)
            return self.activation(outputs)

    def compute_output_spec(self, inputs: Any) -> Any:
        first = inputs[0] if isinstance(inputs, (list, tuple)) else inputs
        return keras.KerasTensor((*first.shape[:-1], self.units), dtype=self.compute_dtype)

    def _bias_values(self) -> list[np.ndarray]:
        return [self.biases[0].numpy()] if self.use_bias else []

    def _assign_bias(self, bias: Sequence[Any]) -> None:
        if self.use_bias:
            self.biases[0].assign(bias[0])


@keras.saving.register_keras_serializable(package="tfdist")
class ParallelMultiHeadAttention(_WholeWeights, keras.layers.Layer):
    """`keras.layers.MultiHeadAttention` with its heads split over the devices.

    Each device holds its heads' query, key and value projections and their rows of the
    output projection, and computes their attention; the K partial outputs are summed
    once, on the first device, where the output bias is added (Megatron-LM's attention
    block: one reduction). `get_weights`/`set_weights` take MultiHeadAttention's whole
    weights, in its order.

    Args:
        num_heads: Attention heads (divisible by the number of devices).
        key_dim: Size of each head for query and key.
        value_dim: Size of each head for value. None: `key_dim`.
        use_bias: Whether the projections have biases.
        kernel_initializer: As MultiHeadAttention's.
        bias_initializer: As MultiHeadAttention's.
        devices: Device names. None: the Runner's (`model_parallel.devices`).

    Call arguments: `query`, `value`, `key=None` (then `value`), `attention_mask=None`
    (boolean, `(B, T, S)`), `use_causal_mask=False`, as MultiHeadAttention's.

    Example:

        attention = ParallelMultiHeadAttention(num_heads=8, key_dim=64)
        outputs = attention(tokens, tokens)   # self-attention
    """

    def __init__(self, num_heads: int, key_dim: int, value_dim: int | None = None,
                 use_bias: bool = True, kernel_initializer: Any = "glorot_uniform",
                 bias_initializer: Any = "zeros", devices: Sequence[str] | None = None,
                 **kwargs: Any):
        super().__init__(**kwargs)
        self.num_heads, self.key_dim = int(num_heads), int(key_dim)
        self.value_dim = int(value_dim) if value_dim else self.key_dim
        self.use_bias = use_bias
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)
        self.devices = resolve_devices(devices, "ParallelMultiHeadAttention")
        if self.num_heads % len(self.devices):
            raise ConfigError(f"ParallelMultiHeadAttention splits its heads over "
                              f"{len(self.devices)} devices, which must divide them. Received: "
                              f"num_heads={self.num_heads}, devices={len(self.devices)}")

    def build(self, query_shape: Any, value_shape: Any, key_shape: Any = None) -> None:
        width = int(query_shape[-1])
        shapes = {"query": (width, self.num_heads, self.key_dim),
                  "key": (int((key_shape or value_shape)[-1]), self.num_heads, self.key_dim),
                  "value": (int(value_shape[-1]), self.num_heads, self.value_dim)}
        self.parts: list[dict[str, Any]] = [{} for _ in self.devices]
        for name, shape in shapes.items():
            # Drawn whole, as MultiHeadAttention draws them, then cut by heads.
            whole = keras.ops.convert_to_numpy(self.kernel_initializer(shape, self.variable_dtype))
            for index, part in enumerate(np.split(whole, len(self.devices), axis=1)):
                self._add(index, f"{name}_kernel", part)
                if self.use_bias:
                    self._add(index, f"{name}_bias", np.zeros(part.shape[1:], "float32"),
                              self.bias_initializer)
        whole = keras.ops.convert_to_numpy(self.kernel_initializer(
            (self.num_heads, self.value_dim, width), self.variable_dtype))
        for index, part in enumerate(np.split(whole, len(self.devices), axis=0)):
            self._add(index, "output_kernel", part)
        if self.use_bias:
            with tf.device(self.devices[0]):
                self.output_bias = self.add_weight(shape=(width,),
                                                   initializer=self.bias_initializer,
                                                   name="output_bias")

    def _add(self, index: int, name: str, value: np.ndarray, initializer: Any = None) -> None:
        with tf.device(self.devices[index]):
            self.parts[index][name] = self.add_weight(
                shape=value.shape, initializer=initializer or keras.initializers.Constant(value),
                name=f"{name}_{index}")

    def call(self, query: Any, value: Any, key: Any = None, attention_mask: Any = None,
             use_causal_mask: bool = False) -> Any:
        key = value if key is None else key
        mask = None
        if attention_mask is not None:
            mask = keras.ops.expand_dims(keras.ops.cast(attention_mask, "bool"), axis=1)
        partials = []
        for index, device in enumerate(self.devices):
            def heads(query, key, value, part=self.parts[index]):
                def project(values, name):
                    out = tf.einsum("abc,cde->abde", values,
                                    tf.cast(part[f"{name}_kernel"], values.dtype))
                    return out + tf.cast(part[f"{name}_bias"], values.dtype) if self.use_bias \
                        else out

                attended = keras.ops.dot_product_attention(
                    project(query, "query"), project(key, "key"), project(value, "value"),
                    mask=mask, scale=1.0 / float(np.sqrt(self.key_dim)),
                    is_causal=use_causal_mask)
                return tf.einsum("abcd,cde->abe", attended,
                                 tf.cast(part["output_kernel"], attended.dtype))

            partials.append(on_device(device, heads, query, key, value))
        with tf.device(self.devices[0]):
            outputs = tf.add_n(partials)  # The block's one reduction.
            if self.use_bias:
                outputs = outputs + tf.cast(self.output_bias, outputs.dtype)
            return outputs

    def compute_output_spec(self, query: Any, value: Any, key: Any = None,
                            attention_mask: Any = None, use_causal_mask: bool = False) -> Any:
        return keras.KerasTensor(query.shape, dtype=self.compute_dtype)

    _ORDER = ("query_kernel", "query_bias", "key_kernel", "key_bias", "value_kernel",
              "value_bias", "output_kernel")

    def _names(self) -> list[str]:
        return [name for name in self._ORDER if self.use_bias or not name.endswith("_bias")]

    def get_weights(self) -> list[np.ndarray]:
        """MultiHeadAttention's: query, key and value kernels and biases, the output kernel
        and bias, each whole."""
        whole = [np.concatenate([part[name].numpy() for part in self.parts],
                                axis=0 if name == "output_kernel" or name.endswith("_bias")
                                else 1) for name in self._names()]
        return whole + ([self.output_bias.numpy()] if self.use_bias else [])

    def set_weights(self, weights: Sequence[Any]) -> None:
        """Takes MultiHeadAttention's weights, in its order."""
        names = self._names()
        for name, value in zip(names, weights):
            axis = 0 if name == "output_kernel" or name.endswith("_bias") else 1
            for part, piece in zip(self.parts, np.split(np.asarray(value), len(self.devices),
                                                        axis=axis)):
                part[name].assign(piece)
        if self.use_bias:
            self.output_bias.assign(weights[len(names)])

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "num_heads": self.num_heads, "key_dim": self.key_dim,
                "value_dim": self.value_dim, "use_bias": self.use_bias,
                "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
                "bias_initializer": keras.initializers.serialize(self.bias_initializer),
                "devices": list(self.devices)}
