"""Keras callbacks tfdist adds to `model.fit`: throughput, and the check that the model
belongs to the run's strategy.

Example:

    throughput = Throughput(global_batch_size=256)
    model.fit(ds, epochs=5, callbacks=[throughput])
    throughput.examples_per_sec   # median over epochs after the first
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import keras

from tfdist.errors import ConfigError


class StrategyScopeCheck(keras.callbacks.Callback):
    """Stops `fit` before its first step when the model was made outside `runner.scope()`.

    Keras ties a model to the strategy in scope when the model object is created,
    and builds its variables under that one. Made outside the scope, a model trains
    on one device beside the others' idle replicas (one_device, Horovod: the default
    device, not the rank's), or fails inside the first step with a bare
    `AssertionError` (mirrored).

    Args:
        strategy: The run's `tf.distribute.Strategy` (`runner.strategy`).
    """

    def __init__(self, strategy: Any):
        super().__init__()
        self.strategy = strategy

    def on_train_begin(self, logs: Any = None) -> None:
        if self.model.distribute_strategy is not self.strategy:
            raise ConfigError(
                f"the model was created outside runner.scope(), so it is not distributed "
                f"by the run's strategy; create (and compile) it inside `with runner.scope():`. "
                f"Received: a model under {type(self.model.distribute_strategy).__name__}, "
                f"the run's strategy is {type(self.strategy).__name__}")


class Throughput(keras.callbacks.Callback):
    """Training examples per second, per epoch, from wall-clock time.

    The first epoch includes tracing and compilation, so `examples_per_sec`
    leaves it out whenever there is more than one.

    Args:
        global_batch_size: Examples per step across all replicas.
    """

    def __init__(self, global_batch_size: int):
        super().__init__()
        self.global_batch_size = global_batch_size
        self.epoch_rates: list[float] = []
        self._started = 0.0
        self._steps = 0

    def on_epoch_begin(self, epoch, logs=None):
        self._steps = 0
        self._started = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self._steps = batch + 1  # Keras passes the last step's index, also per execution.

    def on_epoch_end(self, epoch, logs=None):
        seconds = time.perf_counter() - self._started
        self.epoch_rates.append(self._steps * self.global_batch_size / max(seconds, 1e-9))

    @property
    def examples_per_sec(self) -> float:
        """Median rate over the epochs after the first (or the only epoch's rate)."""
        if not self.epoch_rates:
            return 0.0
        rates = self.epoch_rates[1:] or self.epoch_rates
        return statistics.median(rates)
