"""Pipeline parallelism: a stack of layers cut into stages, one per device, fed
micro-batches whose stages overlap (GPipe, as torchgpipe's `GPipe(module, balance,
chunks)`).

Each stage's layers are built under its device (their variables, and the
optimizer's slots made beside them, live there) and run there, forward and backward
(`tfdist.parallel.placement.on_device`). A batch is cut into `micro_batches` equal
parts that go through the stages one after another; inside Keras's traced train
step TensorFlow's dataflow executor runs an op as soon as its inputs are ready, so
stage 2 of micro-batch 1 runs while stage 1 works on micro-batch 2: that is the
pipeline, with no scheduler of its own. The outputs are joined in order, so the loss,
its gradient and every update are the plain model's on the whole batch.

`Pipeline.layers` are the given layers in order: `get_weights`/`set_weights`,
checkpoints and `model.save` use the layout of a plain `keras.Sequential` of the same
layers, which loads them.

Example:

    with runner.scope():   # model_parallel.devices: 2, micro_batches: 4
        model = Pipeline([keras.layers.Dense(64, activation="relu") for _ in range(4)]
                         + [keras.layers.Dense(10)], input_shape=(32,))
        model.compile(runner.optimizer(keras.optimizers.Adam()), "mse")
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from tfdist.errors import ConfigError
from tfdist.parallel.placement import current_micro_batches, on_device, resolve_devices


def balanced_cut(costs: Sequence[float], stages: int) -> list[int]:
    """Layers per stage: contiguous runs of `costs` whose largest sum is smallest.

    Exact (dynamic programming over the cut points); ties go to the earliest cut.

    Args:
        costs: Each layer's cost, in order.
        stages: How many runs.

    Example:

        balanced_cut([1] * 8, 2)        # [4, 4]
        balanced_cut([4, 1, 1, 1, 1], 2)  # [1, 4]
    """
    count = len(costs)
    prefix = np.concatenate([[0.0], np.cumsum(costs, dtype="float64")])
    # best[s][i]: the smallest largest stage cost of the first i layers in s stages.
    best = np.full((stages + 1, count + 1), np.inf)
    cut = np.zeros((stages + 1, count + 1), dtype=int)
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for i in range(s, count + 1):
            for j in range(s - 1, i):
                value = max(best[s - 1][j], prefix[i] - prefix[j])
                if value < best[s][i] - 1e-12:
                    best[s][i], cut[s][i] = value, j
    sizes, end = [], count
    for s in range(stages, 0, -1):
        sizes.append(int(end - cut[s][end]))
        end = int(cut[s][end])
    return sizes[::-1]


@keras.saving.register_keras_serializable(package="tfdist")
class Pipeline(keras.Model):
    """A stack of layers in pipeline stages over devices, trained on micro-batches.

    Args:
        layers: The layers in order (a list, or an unbuilt `keras.Sequential`, whose
            layers are taken); each takes the previous one's output.
        balance: Layers per stage (sums to the layer count; one stage per device).
            None: cut to balance the stages' parameter counts (`balanced_cut`).
        micro_batches: Parts each batch is cut into (equal where it divides; the
            Runner's dataset checks that training batches do). None: the Runner's
            `model_parallel.micro_batches`, or 1.
        devices: Device names, one per stage. None: the Runner's
            (`model_parallel.devices`).
        input_shape: The shape of one example; builds the model at once (needed for
            `balance=None`, which counts the layers' parameters).
        remat: Keep only the stages' boundary activations; each stage's inside is
            recomputed in the backward pass (`keras.remat`).
        name: The model's name.

    Raises:
        ConfigError: more stages than devices, or a balance that does not cover the
            layers.

    Example:

        model = Pipeline(layers, balance=[2, 2], micro_batches=4,
                         devices=["/device:CPU:0", "/device:CPU:1"], input_shape=(16,))
    """

    def __init__(self, layers: Sequence[keras.layers.Layer] | keras.Sequential,
                 balance: Sequence[int] | None = None, micro_batches: int | None = None,
                 devices: Sequence[str] | None = None,
                 input_shape: Sequence[int | None] | None = None, remat: bool = False,
                 name: str | None = None, **kwargs: Any):
        super().__init__(name=name, **kwargs)
        if isinstance(layers, keras.Sequential):
            layers = [layer for layer in layers.layers
                      if not isinstance(layer, keras.layers.InputLayer)]
        layers = list(layers)
        if not layers:
            raise ConfigError("Pipeline needs at least one layer. Received: layers=[]")
        self.devices = resolve_devices(devices, "Pipeline")
        self.stack = layers  # Tracked by Keras: model.layers lists them in this order.
        self.micro_batches = micro_batches or current_micro_batches()
        if self.micro_batches < 1:
            raise ConfigError(f"Pipeline micro_batches must be an integer >= 1. Received: "
                              f"micro_batches={self.micro_batches}")
        self.remat = remat
        self._requested_balance = None if balance is None else [int(b) for b in balance]
        if balance is not None:
            self._check_balance(self._requested_balance)
            self.balance = self._requested_balance
        else:
            self.balance = None
        if input_shape is not None:
            self.build((None, *input_shape))

    def _check_balance(self, balance: list[int]) -> None:
        if len(balance) > len(self.devices):
            raise ConfigError(f"Pipeline has {len(balance)} stages but {len(self.devices)} "
                              f"devices: give at most one stage per device (set "
                              f"model_parallel.devices to {len(balance)}, or a shorter balance). "
                              f"Received: balance={balance}, devices={list(self.devices)}")
        if sum(balance) != len(self.stack) or min(balance) < 1:
            raise ConfigError(f"Pipeline balance must give each stage at least one layer and "
                              f"sum to the {len(self.stack)} layers. Received: balance={balance} "
                              f"(sum {sum(balance)})")

    @property
    def stages(self) -> list[list[keras.layers.Layer]]:
        """The layers of each stage, in order."""
        starts = np.cumsum([0, *self.balance])
        return [self.stack[a:b] for a, b in zip(starts[:-1], starts[1:])]

    def build(self, input_shape: Any) -> None:
        if self.balance is None:
            counts = self._parameter_counts(input_shape)
            if len(self.stack) < len(self.devices):
                logging.warning("tfdist: Pipeline has %d layers for %d devices: %d devices stay "
                                "idle (a stage holds at least one layer); set "
                                "model_parallel.devices to %d", len(self.stack),
                                len(self.devices), len(self.devices) - len(self.stack),
                                len(self.stack))
            self.balance = balanced_cut(counts, min(len(self.devices), len(self.stack)))
        spec = keras.KerasTensor(tuple(input_shape), dtype=self._input_dtype())
        for device, stage in zip(self.devices, self.stages):
            for layer in stage:
                with tf.device(device):
                    spec = layer(spec)  # Builds it: its variables on the stage's device.
        self.built = True

    def _parameter_counts(self, input_shape: Any) -> list[int]:
        """Each layer's parameters, counted on a copy built from its config and dropped at
        once (so at most one layer's copy exists), before the layers are built on their
        stages' devices."""
        spec = keras.KerasTensor(tuple(input_shape), dtype=self._input_dtype())
        counts = []
        for layer in self.stack:
            with tf.device("/device:CPU:0"):
                copy = type(layer).from_config(layer.get_config())
                spec = copy(spec)
            counts.append(sum(int(np.prod(v.shape)) for v in copy.weights))
            del copy
        return counts

    def _input_dtype(self) -> str:
        first = self.stack[0]
        return "int32" if isinstance(first, keras.layers.Embedding) else "float32"

    def call(self, inputs: Any, training: bool | None = None) -> Any:
        parts = self._micro_batches(inputs)
        outputs = []
        for part in parts:
            for index, (device, stage) in enumerate(zip(self.devices, self.stages)):
                with tf.name_scope(f"pipeline_stage_{index}"):
                    part = on_device(device, functools.partial(
                        self._run_stage, stage, training=training), part)
            outputs.append(part)
        return outputs[0] if len(outputs) == 1 else tf.concat(outputs, axis=0)

    def _run_stage(self, stage: Sequence[keras.layers.Layer], inputs: Any,
                   training: bool | None = None) -> Any:
        def forward(values):
            for layer in stage:
                values = layer(values, training=training)
            return values

        if self.remat:
            return keras.remat(forward)(inputs)
        return forward(inputs)

    def _micro_batches(self, inputs: Any) -> list[Any]:
        """`inputs` cut into `micro_batches` parts along the batch, in order. A batch that
        does not divide (evaluation's last, say) is cut as evenly as it goes: the parts
        joined are the batch, so the result is the same, only the stages less even."""
        count = self.micro_batches
        if count == 1:
            return [inputs]
        batch = tf.shape(inputs, out_type=tf.int32)[0]
        sizes = batch // count + tf.cast(tf.range(count) < batch % count, tf.int32)
        return tf.split(inputs, sizes, num=count, axis=0)

    def compute_output_spec(self, inputs: Any, training: bool | None = None) -> Any:
        spec = inputs
        for layer in self.stack:
            spec = layer.compute_output_spec(spec)
        return spec

    def get_config(self) -> dict[str, Any]:
        return {"name": self.name, "layers": [keras.saving.serialize_keras_object(layer)
                                              for layer in self.stack],
                "balance": self.balance, "micro_batches": self.micro_batches,
                "devices": list(self.devices), "remat": self.remat}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "Pipeline":
        config = dict(config)
        config["layers"] = [keras.saving.deserialize_keras_object(layer)
                            for layer in config["layers"]]
        return cls(**config)
