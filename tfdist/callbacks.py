"""Keras callbacks tfdist adds to `model.fit`.

Example:

    throughput = Throughput(global_batch_size=256)
    model.fit(ds, epochs=5, callbacks=[throughput])
    throughput.examples_per_sec   # median over epochs after the first
"""

from __future__ import annotations

import statistics
import time

import keras


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
