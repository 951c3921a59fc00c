"""Horovod's Keras callbacks (`horovod.tensorflow.keras.callbacks`) for Keras 3.

Broadcast and metric averaging are the `horovod` adapter's own
(`tfdist.horovod.collectives`). The learning-rate callbacks set the optimizer's
learning-rate variable between steps, as Keras's `LearningRateScheduler` does.
Momentum correction is refused where it would apply: Keras 3 traces an optimizer's
`momentum` into the train step as a constant, so a callback cannot change it.

Example:

    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                 hvd.callbacks.MetricAverageCallback(),
                 hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.01 * hvd.size(),
                                                          warmup_epochs=3,
                                                          momentum_correction=False)]
"""

from __future__ import annotations

from typing import Any, Callable

import horovod.tensorflow as _hvd
import keras
import tensorflow as tf
from horovod.common.util import is_version_greater_equal_than  # noqa: F401 (Horovod's name)

from tfdist.errors import ConfigError
from tfdist.horovod.collectives import AverageMetrics, BroadcastState


class BroadcastGlobalVariablesCallback(BroadcastState):
    """Copies `root_rank`'s weights and optimizer state to every rank before the first step.

    (Horovod's Keras 2 callback broadcast after the first step, so that step's
    gradients came from different weights on each rank; this one broadcasts before.)

    Args:
        root_rank: The rank whose state every rank takes.
        device: Where the broadcast runs ("": Horovod's default).
        local_variables: A variable or variables each rank keeps as they are.

    Example:

        model.fit(dataset, callbacks=[BroadcastGlobalVariablesCallback(0)])
    """

    def __init__(self, root_rank: int, device: str = "", local_variables: Any = None):
        if local_variables is None:
            local_variables = []
        elif isinstance(local_variables, (tf.Variable, keras.Variable)):
            local_variables = [local_variables]
        elif not all(isinstance(variable, (tf.Variable, keras.Variable))
                     for variable in local_variables):
            raise ConfigError(f"local_variables must be variables (model.layers[i].variables). "
                              f"Received: {local_variables!r}")
        super().__init__(_hvd, root_rank=root_rank, local_variables=local_variables)
        self.device = device

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        with tf.device(self.device):
            super().on_train_batch_begin(batch, logs)


class MetricAverageCallback(AverageMetrics):
    """Replaces each logged metric by its mean over the ranks at each epoch's end (and
    evaluation's). Put it before callbacks that read the metrics.

    Args:
        device: Accepted for Horovod's signature; the averages are computed on the host.

    Example:

        model.fit(dataset, callbacks=[MetricAverageCallback(), keras.callbacks.CSVLogger(path)])
    """

    def __init__(self, device: str = ""):
        super().__init__(_hvd)
        self.device = device


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Sets the learning rate to `initial_lr * multiplier(epoch)` from `start_epoch` to
    `end_epoch` (exclusive).

    Args:
        initial_lr: The learning rate at the start of training (required, as in Horovod).
        multiplier: A constant (decay: `multiplier ** (epoch - start_epoch)`) or a
            function of the epoch.
        start_epoch: The first epoch adjusted.
        end_epoch: The epoch where adjusting stops (None: never).
        staircase: True: set at the start of each epoch, from the epoch number. False:
            at each batch, from `epoch + batch / steps_per_epoch`.
        momentum_correction: Refused with an optimizer whose momentum is not 0 (Keras 3
            traces momentum as a constant); pass False.
        steps_per_epoch: Batches per epoch; None: read from `fit` (needs a known size).

    Example:

        LearningRateScheduleCallback(initial_lr=0.1, multiplier=0.1, start_epoch=30)
    """

    def __init__(self, initial_lr: float, multiplier: float | Callable[[float], float],
                 start_epoch: int = 0, end_epoch: int | None = None, staircase: bool = True,
                 momentum_correction: bool = True, steps_per_epoch: int | None = None):
        super().__init__()
        if initial_lr is None:
            raise ConfigError("initial_lr is required: pass the learning rate at the start of "
                              "training. Received: initial_lr=None")
        self.initial_lr = initial_lr
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch: int | None = None
        if callable(multiplier):
            self.multiplier = multiplier
        else:
            self.multiplier = lambda epoch: multiplier ** (epoch - start_epoch)

    def on_train_begin(self, logs: Any = None) -> None:
        optimizer = self.model.optimizer
        momentum = getattr(optimizer, "momentum", 0.0)
        if self.momentum_correction and isinstance(momentum, (int, float)) and momentum:
            raise ConfigError(
                f"{type(self).__name__}: momentum correction cannot work on Keras 3, which "
                f"traces the optimizer's momentum into the train step as a constant; pass "
                f"momentum_correction=False. Received: momentum={momentum}")
        if isinstance(optimizer._learning_rate,
                      keras.optimizers.schedules.LearningRateSchedule):
            raise ConfigError(f"{type(self).__name__} sets the learning rate, but this optimizer "
                              f"follows a schedule; build it with a float learning rate. "
                              f"Received: {type(optimizer._learning_rate).__name__}")
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self.params.get("steps")
            if not self.steps_per_epoch:
                raise ConfigError(f"{type(self).__name__} could not tell the number of steps "
                                  f"per epoch; pass steps_per_epoch (or steps_per_epoch to "
                                  f"fit). Received: steps=None")

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self.current_epoch = epoch

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        epoch = self.current_epoch
        if epoch < self.start_epoch or (self.end_epoch is not None and epoch >= self.end_epoch):
            return
        if self.staircase and batch == 0:
            self._set(epoch)
        elif not self.staircase:
            self._set(epoch + float(batch) / self.steps_per_epoch)

    def _set(self, epoch: float) -> None:
        self.model.optimizer.learning_rate = self.initial_lr * self.multiplier(epoch)

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        if logs is not None:
            logs["lr"] = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Raises the learning rate from `initial_lr / size` to `initial_lr` over
    `warmup_epochs` ("Accurate, Large Minibatch SGD", arXiv:1706.02677), every batch.

    Args:
        initial_lr: The learning rate after the warm-up (usually the base rate x size).
        warmup_epochs: Epochs of warm-up.
        momentum_correction: As `LearningRateScheduleCallback`.
        steps_per_epoch: Batches per epoch; None: read from `fit`.
        verbose: 1: rank 0 prints when the warm-up ends.

    Example:

        LearningRateWarmupCallback(initial_lr=0.001 * hvd.size(), warmup_epochs=3)
    """

    def __init__(self, initial_lr: float, warmup_epochs: int = 5,
                 momentum_correction: bool = True, steps_per_epoch: int | None = None,
                 verbose: int = 0):
        def multiplier(epoch: float) -> float:
            # As Horovod: shifted by one batch, so that each epoch ends on a round value.
            epoch += 1.0 / self.steps_per_epoch
            return 1.0 / _hvd.size() * (epoch * (_hvd.size() - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs,
                         staircase=False, momentum_correction=momentum_correction,
                         steps_per_epoch=steps_per_epoch)
        self.verbose = verbose

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0 and _hvd.rank() == 0:
            rate = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to {rate:g}.")


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """`keras.callbacks.ModelCheckpoint` that keeps only the best model.

    Horovod's estimators set `filepath` after constructing it; so may you, or pass it.

    Args:
        monitor, verbose, save_weights_only, mode, save_freq: As `ModelCheckpoint`.
        filepath: Where to save (`.keras`, or `.weights.h5` with `save_weights_only`);
            None: set `callback.filepath` before `fit`.

    Example:

        checkpoint = BestModelCheckpoint(monitor="val_loss", filepath="best.keras")
    """

    def __init__(self, monitor: str = "val_loss", verbose: int = 0,
                 save_weights_only: bool = False, mode: str = "auto",
                 save_freq: str | int = "epoch", filepath: str | None = None):
        placeholder = "best.weights.h5" if save_weights_only else "best.keras"
        super().__init__(filepath=filepath or placeholder, monitor=monitor, verbose=verbose,
                         save_best_only=True, save_weights_only=save_weights_only, mode=mode,
                         save_freq=save_freq)
        if filepath is None:
            self.filepath = None

    def on_train_begin(self, logs: Any = None) -> None:
        if self.filepath is None:
            raise ConfigError("BestModelCheckpoint has no filepath; pass filepath= or set "
                              "callback.filepath (a .keras file) before fit. "
                              "Received: filepath=None")
        super().on_train_begin(logs)
