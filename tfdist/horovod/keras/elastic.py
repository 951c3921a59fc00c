"""Horovod elastic for Keras 3 models (`horovod.tensorflow.keras.elastic`).

Horovod's `KerasState` fails on Keras 3 (it calls `optimizer.variables()`, a list
in Keras 3), and its `run` recognises a lost peer only in three op names (not the
grouped allreduce `DistributedOptimizer` uses). Here `KerasState` keeps a Keras 3
model's and optimizer's variables (and any Python values given to it) in memory
at each commit, and `run` is `tfdist.horovod.elastic.run`, which treats any failed Horovod
collective as a lost peer. The callbacks are Horovod's own, which are plain Python.

Keras 3 does not let a callback shorten an epoch: after a reset in the middle of
an epoch, `UpdateBatchStateCallback` records the batch, but that epoch runs all its
steps again from the commit's weights (an exact resume: `tfdist.Runner.run_elastic`).

Example (under `horovodrun -np 2 --min-np 1 ...`):

    state = hvd.elastic.KerasState(model, batch=0, epoch=0)

    @hvd.elastic.run
    def train(state):
        model.fit(dataset, initial_epoch=state.epoch, epochs=5,
                  callbacks=[hvd.elastic.CommitStateCallback(state),
                             hvd.elastic.UpdateEpochStateCallback(state)])

    train(state)
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import horovod.tensorflow as _hvd
import keras
from horovod._keras import elastic as _impl

from tfdist.horovod import elastic as _elastic
from tfdist.errors import ConfigError
from tfdist.horovod.collectives import tf_variable


class KerasState(_elastic.elastic_state_cls()):
    """The state of a Keras 3 model and its optimizer, committed in memory.

    Args:
        model: A built Keras model.
        optimizer: Its optimizer; None: `model.optimizer`.
        **kwargs: Python values kept with the state, as attributes (`batch`, `epoch`).

    Example:

        state = KerasState(model, batch=0, epoch=0)
        state.commit()      # after some steps
        state.restore()     # the weights, optimizer state, batch and epoch of the commit
    """

    def __init__(self, model: Any, optimizer: Any = None, **kwargs: Any):
        if not model.built:
            raise ConfigError("KerasState needs a built model; call model.build(input_shape) "
                              "or the model on a batch first. Received: an unbuilt model")
        super().__init__(_hvd, **kwargs)
        self.model = model
        self.optimizer = optimizer or model.optimizer
        self._committed = self._snapshot()

    def state_variables(self) -> list[Any]:
        optimizer = self.optimizer
        if optimizer is not None and not optimizer.built:
            optimizer.build(self.model.trainable_variables)
        variables = list(self.model.variables) + (list(optimizer.variables) if optimizer else [])
        return [tf_variable(variable) for variable in variables]

    def _snapshot(self) -> list[Any]:
        return [variable.numpy() for variable in self.state_variables()]

    def sync(self) -> None:
        super().sync()
        # What every rank holds now is the state to go back to, as in Horovod.
        self._committed = self._snapshot()


TensorFlowKerasState = KerasState


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorates a training function `func(state, ...)` to run under Horovod elastic.

    After a collective fails (a rank lost) or hosts change, the last commit is
    restored, Horovod is re-initialised with the ranks there are, rank 0's state is
    broadcast, and `func` is called again.

    Example:

        @run
        def train(state):
            model.fit(...)
    """
    @functools.wraps(func)
    def wrapper(state: Any, *args: Any, **kwargs: Any) -> Any:
        def on_reset() -> None:
            model = getattr(state, "model", None)
            if isinstance(model, keras.Model):
                # Traced steps hold the old number of ranks.
                model.train_function = model.test_function = model.predict_function = None

        return _elastic.run(_hvd, state, lambda: func(state, *args, **kwargs), on_reset)

    return wrapper


class CommitStateCallback(_impl.CommitStateCallbackImpl, keras.callbacks.Callback):
    """Commits `state` every `batches_per_commit` batches and at each epoch's end.

    Args:
        state: A `KerasState` (or any Horovod elastic state).
        batches_per_commit: Batches between commits.
    """

    def __init__(self, state: Any, batches_per_commit: int = 1):
        super().__init__(keras.backend, state, batches_per_commit)


class UpdateBatchStateCallback(_impl.UpdateBatchStateCallbackImpl, keras.callbacks.Callback):
    """Sets `state.batch` to the current batch after each batch, and to 0 at each epoch's end.

    Args:
        state: A `KerasState` with a `batch` attribute.
    """

    def __init__(self, state: Any):
        super().__init__(keras.backend, state)


class UpdateEpochStateCallback(_impl.UpdateEpochStateCallbackImpl, keras.callbacks.Callback):
    """Sets `state.epoch` to the number of epochs done (across resets) at each epoch's end.

    Args:
        state: A `KerasState` with an `epoch` attribute.
    """

    def __init__(self, state: Any):
        super().__init__(keras.backend, state)


__all__ = ["CommitStateCallback", "KerasState", "TensorFlowKerasState",
           "UpdateBatchStateCallback", "UpdateEpochStateCallback", "run"]
