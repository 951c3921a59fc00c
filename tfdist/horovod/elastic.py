"""Horovod elastic under Keras 3: training goes on with the ranks left after one is lost.

Under `horovodrun --min-np N ...` Horovod's driver replaces or drops a failed rank
and tells the others to reset; `horovod.tensorflow.elastic.run` then restores the
state last committed in memory, re-initialises Horovod with the new set of ranks,
broadcasts rank 0's state, and calls the training function again. Horovod's own
Keras state fails on Keras 3 (`TensorFlowKerasState` calls `optimizer.variables()`,
a list in Keras 3), and its wrapper recognises a lost peer only in three op names
(not `HorovodGroupedAllreduce`, which tfdist's gradient reduction uses) and
silently returns None for any other `UnknownError`.

Here, `KerasElasticState` is the Horovod `State` of a Keras 3 model: the model's
variables, the optimizer's, the metrics' totals and tfdist's training position,
committed by `tfdist.resume.backup.BackupAndRestore` wherever it would save. After a
reset, the adapter follows the new size (each rank's slice of the global batch,
the learning-rate multiplier) and `fit` resumes from the commit exactly as it
would from a checkpoint.

Example (every rank, under horovodrun --gloo --min-np 1 -np 2 ...):

    runner = tfdist.Runner(tfdist.load_config(overrides={"strategy": "horovod"}))
    with runner.scope():
        model = build_model()
        model.compile(runner.optimizer(keras.optimizers.Adam(1e-3)), "mse")

    def train():
        model.fit(runner.dataset(ds, 64), epochs=5,
                  callbacks=runner.callbacks(save_every_steps=100))

    runner.run_elastic(train)
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Callable

import numpy as np
import tensorflow as tf
from absl import logging

from tfdist.errors import first_line
from tfdist.resume.checkpointing import TrainingPosition
from tfdist.horovod.collectives import tf_variable as _tf_variable


def elastic_state_cls() -> type:
    """`KerasElasticState`, defined once Horovod is importable (its base class is Horovod's)."""
    from horovod.common.elastic import ObjectState

    class KerasElasticState(ObjectState):
        """The state Horovod elastic commits, restores and broadcasts, for a Keras 3 model.

        The model is attached by the first `fit` (`attach`); until then there is
        nothing to restore or broadcast.

        Args:
            hvd: The `horovod.tensorflow` module, initialised.
            **kwargs: Python values kept with the state (attributes, committed,
                restored and broadcast from rank 0 with it), as Horovod's states take.
        """

        def __init__(self, hvd: ModuleType, **kwargs: Any):
            self._hvd = hvd
            self._variables: list[Any] = []
            self._committed: list[np.ndarray] | None = None
            self.model: Any = None
            self.position: TrainingPosition | None = None
            self.resets = 0
            super().__init__(bcast_object=hvd.broadcast_object, get_rank=hvd.rank, **kwargs)

        @property
        def has_commit(self) -> bool:
            return self._committed is not None

        def attach(self, model: Any, variables: list[Any], position: TrainingPosition) -> None:
            """What the state holds: the fit's model, its variables in a fixed order, and
            its position."""
            self.model = model
            self._variables = [_tf_variable(variable) for variable in variables]
            self.position = position

        def state_variables(self) -> list[Any]:
            """The `tf.Variable`s committed, restored and broadcast, in a fixed order."""
            return self._variables

        def save(self) -> None:
            self._committed = [variable.numpy() for variable in self.state_variables()]
            super().save()

        def restore(self) -> None:
            if self._committed is not None:
                for variable, value in zip(self.state_variables(), self._committed):
                    variable.assign(value)
            super().restore()

        def sync(self) -> None:
            variables = self.state_variables()
            if variables:
                self._hvd.broadcast_variables(variables, root_rank=0)
            super().sync()

        def reset(self) -> None:
            self.resets += 1

    return KerasElasticState


def run(hvd: ModuleType, state: Any, train: Callable[[], Any],
        on_reset: Callable[[], None]) -> Any:
    """Calls `train()` under Horovod elastic, again after every reset, until it returns.

    Args:
        hvd: The `horovod.tensorflow` module, initialised.
        state: A `KerasElasticState`.
        train: The training function (calls `model.fit`); takes no arguments.
        on_reset: Called after Horovod has been re-initialised with the new ranks.

    Returns:
        What `train` returns.
    """
    from horovod.common.elastic import run_fn
    from horovod.common.exceptions import HorovodInternalError

    def attempt(_: Any) -> Any:
        try:
            return train()
        except tf.errors.OpError as error:
            if "Horovod" not in str(error):
                raise
            logging.warning("tfdist: a Horovod collective failed (%s); restoring the last "
                            "commit and going on with the ranks left",
                            first_line(error))
            raise HorovodInternalError(error) from error

    def reset() -> None:
        hvd.shutdown()
        hvd.init()
        on_reset()

    return run_fn(attempt, reset)(state)
