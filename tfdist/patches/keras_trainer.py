"""Patches to Keras 3's TensorFlow trainer (`keras/src/backend/tensorflow/trainer.py`).

- Under MultiWorkerMirroredStrategy, `model.fit` fails twice before its first step
  (keras-team/keras#20585, tensorflow/tensorflow#72388): building the model averages
  a per-replica data batch, and the step outputs are averaged over an axis a scalar
  does not have.
- Under ParameterServerStrategy, Keras 3 has no training loop at all
  (keras-team/keras#18624): `fit`, `evaluate` and `predict` of a model built under
  the strategy go to tfdist's coordinated loop instead.

- Horovod's Keras scripts (`tfdist.horovod.keras`, no tf.distribute strategy) meet
  two Keras 3 changes: `compile` refuses `experimental_run_tf_function`, which
  Horovod's TF2 Keras documentation and examples pass; and a model without an `Input`
  is built only when its first step is traced, after the callbacks have started, so
  the broadcast of rank 0's state before the first step sees no variables (and builds
  the optimizer for none: "Unknown variable" at the first update). With Horovod
  initialised, the keyword is accepted and ignored (noted once), and
  such a model is built from its first batch before `fit` starts its callbacks, as
  Keras does under a strategy.
- At zero_stage 3, a model with no `Input` is built on its first batch inside `fit`,
  under the model's strategy's scope but not `runner.scope()`, whose variable creator
  stores each trainable variable as this rank's slice: the model's weights would be
  whole. Where the model's optimizer is a sharded one, the build runs under its
  `creation_scope()` (at stage 3, `tfdist.sharding.sharded_creation`).

Each replacement acts only for models under the strategy whose bug it fixes and calls
Keras's own code for every other model.

Example:

    from tfdist.patches import keras_trainer

    keras_trainer.MULTI_WORKER_SYMBOLIC_BUILD.apply()
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

from tfdist.patches.base import Patch, source_contains


def _trainer_module() -> Any:
    from keras.src.backend.tensorflow import trainer

    return trainer


def _trainer_class() -> Any:
    return _trainer_module().TensorFlowTrainer


def _in_multi_worker_mode(strategy: Any) -> bool:
    return strategy is not None and _trainer_module()._collective_all_reduce_multi_worker(
        strategy)


def _first_replica_batch(original: Callable) -> Callable:
    import tensorflow as tf
    from keras.src import tree

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        if iterator is None or not _in_multi_worker_mode(self._distribute_strategy):
            return original(self, iterator=iterator, data_batch=data_batch)
        # Building needs only the batch's shapes and dtypes, which every replica's
        # slice has: take this worker's first slice instead of a cross-worker mean.
        for _, _, batches in iterator:
            data_batch = tree.map_structure(
                lambda value: (
                    self.distribute_strategy.experimental_local_results(value)[0]
                    if isinstance(value, tf.distribute.DistributedValues) else value),
                next(batches))
            break
        return original(self, iterator=None, data_batch=data_batch)

    return _maybe_symbolic_build


MULTI_WORKER_SYMBOLIC_BUILD = Patch(
    "keras.trainer.multi_worker_symbolic_build",
    owner=_trainer_class, attribute="_maybe_symbolic_build",
    replacement=_first_replica_batch,
    bug_present=lambda original: source_contains(original, "distribute_strategy.reduce"),
    upstream="keras-team/keras#20585, tensorflow/tensorflow#72388",
    summary="model.fit under MultiWorkerMirroredStrategy fails building the model: "
            "'Attempt to convert a value (PerReplica...)'")


def _horovod_running() -> bool:
    """Whether this program has initialised Horovod."""
    from tfdist.patches.keras_normalization import initialized_horovod

    return initialized_horovod() is not None


def _built_before_callbacks(original: Callable) -> Callable:
    import tensorflow as tf

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        unbuilt = not all(layer.built for layer in self._flatten_layers())
        if self._distribute_strategy is not None or not unbuilt or not _horovod_running():
            return original(self, iterator=iterator, data_batch=data_batch)
        # Keras builds here only under a strategy; the default strategy stands in for
        # the call (one batch read, as under any strategy).
        self._distribute_strategy = tf.distribute.get_strategy()
        try:
            return original(self, iterator=iterator, data_batch=data_batch)
        finally:
            self._distribute_strategy = None

    return _maybe_symbolic_build


HOROVOD_BUILD_BEFORE_CALLBACKS = Patch(
    "keras.trainer.horovod_build_before_callbacks",
    owner=_trainer_class, attribute="_maybe_symbolic_build",
    replacement=_built_before_callbacks,
    bug_present=lambda original: source_contains(original,
                                                 "if self._distribute_strategy is None"),
    upstream="none filed: Keras 3 defers building a model outside any strategy to its "
             "first traced step (keras/src/backend/tensorflow/trainer.py)",
    summary="a Horovod Keras model without an Input is built after the broadcast callback "
            "started: 'Unknown variable' at the first update")


def _creating_optimizer(model: Any) -> Any:
    """The optimizer in the chain of tfdist's wrappers around `model.optimizer` that says
    where the model's weights are created (a sharded one's `creation_scope`), or None.
    Found by that method, not `tfdist.sharding.find_sharded`: patches import nothing of
    tfdist's above them (tests/test_layout.py)."""
    optimizer = getattr(model, "optimizer", None)
    while optimizer is not None and not hasattr(optimizer, "creation_scope"):
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return optimizer


def _built_under_creation_scope(original: Callable) -> Callable:
    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        optimizer = _creating_optimizer(self)
        if optimizer is None:
            return original(self, iterator=iterator, data_batch=data_batch)
        with optimizer.creation_scope(self):
            return original(self, iterator=iterator, data_batch=data_batch)

    return _maybe_symbolic_build


ZERO_BUILD_IN_CREATION_SCOPE = Patch(
    "keras.trainer.zero_build_in_creation_scope",
    owner=_trainer_class, attribute="_maybe_symbolic_build",
    replacement=_built_under_creation_scope,
    bug_present=lambda original: source_contains(original, "self._symbolic_build("),
    upstream="none filed: Keras builds a model without an Input inside fit, under its "
             "strategy's scope, where tfdist's runner.scope() variable creator is not "
             "(keras/src/backend/tensorflow/trainer.py)",
    summary="at zero_stage 3, a model built on its first batch in fit is refused: its "
            "variables were created whole, outside runner.scope()")

_noted_run_tf_function = False


def _accepts_run_tf_function(original: Callable) -> Callable:
    from absl import logging

    @functools.wraps(original)
    def compile(self, *args, **kwargs):
        global _noted_run_tf_function
        if "experimental_run_tf_function" not in kwargs or not _horovod_running():
            return original(self, *args, **kwargs)  # Keras's own TypeError for the keyword
        del kwargs["experimental_run_tf_function"]
        if not _noted_run_tf_function:
            _noted_run_tf_function = True
            logging.warning("tfdist.horovod.keras: compile(experimental_run_tf_function=...) "
                            "is ignored: Keras 3 always runs its train step as a tf.function, "
                            "and DistributedOptimizer reduces the gradients inside it")
        return original(self, *args, **kwargs)

    return compile


def _refuses_run_tf_function(original: Callable) -> bool:
    parameters = inspect.signature(original).parameters
    return ("experimental_run_tf_function" not in parameters
            and not any(p.kind is p.VAR_KEYWORD for p in parameters.values()))


def _trainer_base_class() -> Any:
    from keras.src.trainers import trainer

    return trainer.Trainer


HOROVOD_COMPILE_KEYWORD = Patch(
    "keras.trainer.horovod_compile_keyword",
    owner=_trainer_base_class, attribute="compile",
    replacement=_accepts_run_tf_function, bug_present=_refuses_run_tf_function,
    upstream="none filed: Keras 3 removed the keyword that Horovod's TF2 Keras docs and "
             "examples pass",
    summary="compile(..., experimental_run_tf_function=False), as Horovod's docs write it, "
            "raises TypeError")


def _mean_over_replicas(original: Callable) -> Callable:
    from keras.src import tree

    def reduce_per_replica(values, strategy, reduction):
        if reduction in ("auto", "mean") and _in_multi_worker_mode(strategy):
            # One worker averages its replicas with reduce_mean(axis=0); across
            # workers the same mean is a reduce over every replica with axis=None.
            return tree.map_structure(
                lambda value: strategy.reduce("MEAN", value, axis=None), values)
        return original(values, strategy, reduction)

    return reduce_per_replica


MULTI_WORKER_METRIC_REDUCTION = Patch(
    "keras.trainer.multi_worker_metric_reduction",
    owner=_trainer_module, attribute="reduce_per_replica",
    replacement=_mean_over_replicas,
    bug_present=lambda original: source_contains(original,
                                                 'strategy.reduce("MEAN", v, axis=0)'),
    upstream="tensorflow/tensorflow#72388",
    summary="model.fit under MultiWorkerMirroredStrategy fails after its first step: "
            "'Invalid reduction dimension 0 for input with 0 dimensions'")


def _uses_parameter_servers(model: Any) -> bool:
    import tensorflow as tf

    return isinstance(getattr(model, "_distribute_strategy", None),
                      tf.distribute.experimental.ParameterServerStrategy)


# tfdist's coordinated loop (an object with `fit`, `evaluate` and `predict`), handed in by
# the parameter_server adapter (`set_parameter_server_loop`): patches/ imports nothing of
# tfdist above it.
_parameter_server_loop: Any = None


def set_parameter_server_loop(loop: Any) -> None:
    """Where the routed `fit`/`evaluate`/`predict` send models built under
    ParameterServerStrategy.

    Args:
        loop: An object whose `fit`, `evaluate` and `predict` take (model, Keras's own
            method, Keras's arguments by name), as
            `tfdist.adapters.parameter_server.coordinated_fit` does.
    """
    global _parameter_server_loop
    _parameter_server_loop = loop


def _routed(name: str) -> Callable[[Callable], Callable]:
    """A replacement for Keras's `fit`/`evaluate`/`predict` that sends models built
    under ParameterServerStrategy to tfdist's coordinated loop."""

    def replacement(original: Callable) -> Callable:
        signature = inspect.signature(original)

        @functools.wraps(original)
        def method(self, *args, **kwargs):
            if not _uses_parameter_servers(self):
                return original(self, *args, **kwargs)
            # Bound to Keras's own signature: positional arguments reach the loop by
            # name, a wrong one is Keras's own TypeError, and a keyword a newer Keras
            # adds reaches the loop, which refuses what it cannot honour.
            given = dict(signature.bind(self, *args, **kwargs).arguments)
            del given["self"]
            given.update(given.pop("kwargs", {}))
            if _parameter_server_loop is None:
                raise RuntimeError(f"model.{name} under ParameterServerStrategy runs in "
                                   f"tfdist's coordinated loop, which no parameter_server "
                                   f"Runner has set up in this process; build the model "
                                   f"under tfdist.Runner(strategy parameter_server).scope()")
            return getattr(_parameter_server_loop, name)(self, original, **given)

        return method

    return replacement


def _has_no_parameter_server_loop(original: Callable) -> bool:
    # Keras 3's trainer never builds a ClusterCoordinator: fit under the strategy
    # fails in TensorFlow's input pipeline.
    return not source_contains(_trainer_module(), "ClusterCoordinator")


PARAMETER_SERVER_FIT, PARAMETER_SERVER_EVALUATE, PARAMETER_SERVER_PREDICT = (
    Patch(f"keras.trainer.parameter_server_{name}",
          owner=_trainer_class, attribute=name, replacement=_routed(name),
          bug_present=_has_no_parameter_server_loop,
          upstream="keras-team/keras#18624",
          summary=f"model.{name} under ParameterServerStrategy fails: 'pass this dataset to "
                  f"ClusterCoordinator.create_per_worker_dataset'")
    for name in ("fit", "evaluate", "predict"))
