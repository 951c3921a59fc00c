"""Keras 3 `model.fit`, `evaluate` and `predict` under ParameterServerStrategy.

Keras 3 dropped parameter-server training (keras-team/keras#18624): `model.fit`
under the strategy fails with `ValueError: ... pass this dataset to
ClusterCoordinator.create_per_worker_dataset`. The patches
`keras.trainer.parameter_server_{fit,evaluate,predict}` (tfdist.patches.keras_trainer)
route the three methods of a model built under a ParameterServerStrategy here; every
other model keeps Keras's own code. The user's call does not change:

    with runner.scope():                     # strategy: parameter_server
        model = build_model()
        model.compile(optimizer=runner.optimizer("adam"), loss="mse")
    history = model.fit(runner.dataset(train, global_batch_size=64), epochs=3,
                        validation_data=runner.dataset(test, 64, drop_remainder=False))

How it trains (on the chief, which holds the `ClusterCoordinator`):

- Each worker reads its own copy of the batched dataset, serialized to it and
  repeated, and takes every n-th batch (n workers, its slot counted on a
  parameter server when its copy is built).
- An epoch is `steps_per_epoch` steps (default: the batches in one pass of the
  dataset). Steps are scheduled in functions of `steps_per_execution` steps;
  any free worker runs the next one, asynchronously.
- Epoch ends wait for every scheduled step; then the metrics (summed on the
  parameter servers by every worker's steps) are read, `validation_data` is
  evaluated, and epoch-level callbacks run. Batch-level callbacks run as each
  function is scheduled, with empty logs: the steps may not have run yet.
- At-least-once: when a worker fails, the functions it held run again on
  another worker, so a step can apply its update twice; steps are never lost.
  `optimizer.iterations` counts each scheduled step once: after the last step of
  each epoch it is set back to the steps scheduled when a re-run step counted
  twice (logged as a warning).
- A parameter server that fails ends training with `ClusterError` naming it.
- `evaluate` and `predict` run on the chief, which reads the variables from the
  parameter servers: each example exactly once, in order.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any, Iterator

import tensorflow as tf
from absl import logging

from tfdist.errors import ClusterError, ConfigError


def fit(model: Any, keras_fit: Any, x: Any = None, y: Any = None, batch_size: int | None = None,
        epochs: int = 1, verbose: Any = "auto", callbacks: Any = None,
        validation_split: float = 0.0, validation_data: Any = None, shuffle: bool = True,
        class_weight: Any = None, sample_weight: Any = None, initial_epoch: int = 0,
        steps_per_epoch: int | None = None, validation_steps: int | None = None,
        validation_batch_size: int | None = None, validation_freq: int = 1,
        **others: Any) -> Any:
    """`model.fit` for a model built under ParameterServerStrategy (see the module).

    Takes Keras's arguments. `x` is a batched `tf.data.Dataset` (what
    `runner.dataset` returns) or arrays with `y` and `batch_size`.

    Args:
        model: The compiled model.
        keras_fit: Keras's own `fit` (unused: it has no loop for this strategy).
        **others: Keywords of a newer Keras that this loop does not know: refused.

    Raises:
        ConfigError: an argument this loop cannot honour.
        ClusterError: a parameter server failed.
    """
    del keras_fit, shuffle  # Datasets shuffle themselves; arrays keep their order.
    if others:
        raise ConfigError(f"model.fit under parameter_server does not take "
                          f"{', '.join(sorted(others))} yet; leave it out. "
                          f"Received: {others!r}")
    for name, value in (("class_weight", class_weight), ("sample_weight", sample_weight),
                        ("validation_split", validation_split)):
        if value:
            raise ConfigError(f"model.fit under parameter_server does not take {name}; put "
                              f"it in the dataset (or pass validation_data). "
                              f"Received: {name}={value!r}")
    model._assert_compile_called("fit")
    dataset = _as_dataset(x, y, batch_size)
    steps_per_epoch = _steps_per_epoch(dataset, steps_per_epoch)
    strategy = model.distribute_strategy
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    _build(model, dataset)

    import keras

    callbacks = keras.callbacks.CallbackList(
        callbacks, add_history=True, add_progbar=verbose != 0, verbose=verbose,
        epochs=epochs, steps=steps_per_epoch, model=model)
    with _translated_cluster_errors(strategy):
        iterator = _per_worker_iterator(coordinator, dataset, strategy)
        steps_per_execution = int(model.steps_per_execution)
        functions = _TrainFunctions(model, strategy)
        model.stop_training = False
        callbacks.on_train_begin()  # A checkpoint callback restores here.
        iterations = model.optimizer.iterations
        scheduled = int(iterations.numpy())
        initial_epoch = model._initial_epoch or initial_epoch
        logs: dict[str, Any] = {}
        for epoch in range(initial_epoch, epochs):
            model.reset_metrics()
            callbacks.on_epoch_begin(epoch)
            step = _steps_done(callbacks)
            while step < steps_per_epoch and not model.stop_training:
                count = min(steps_per_execution, steps_per_epoch - step)
                callbacks.on_train_batch_begin(step)
                coordinator.schedule(functions.get(count), args=(iterator,))
                step += count
                scheduled += count
                if _wants_state(callbacks, step):
                    coordinator.join()
                    _count_each_step_once(iterations, scheduled)
                callbacks.on_train_batch_end(step - 1, {})
            coordinator.join()
            _count_each_step_once(iterations, scheduled)
            logs = dict(model.get_metrics_result())
            if validation_data is not None and model._should_eval(epoch, validation_freq):
                val_logs = model.evaluate(
                    _as_dataset(validation_data, None, validation_batch_size or batch_size),
                    steps=validation_steps, callbacks=callbacks, return_dict=True, verbose=0)
                logs.update({f"val_{name}": value for name, value in val_logs.items()})
            callbacks.on_epoch_end(epoch, logs)
            if model.stop_training:
                break
        callbacks.on_train_end(logs=logs)
    return model.history


def _steps_done(callbacks: Any) -> int:
    """Steps of this epoch a restored checkpoint has done already (0 without one)."""
    return max([getattr(callback, "steps_to_skip", 0) for callback in callbacks.callbacks],
               default=0)


def _wants_state(callbacks: Any, steps_done: int) -> bool:
    """Whether a callback (a checkpoint) needs the state after `steps_done` steps: then the
    steps scheduled so far must finish before it runs."""
    return any(callback.wants_state_at_step(steps_done) for callback in callbacks.callbacks
               if hasattr(callback, "wants_state_at_step"))


def evaluate(model: Any, keras_evaluate: Any, x: Any = None, **arguments: Any) -> Any:
    """`model.evaluate` on the chief, reading the servers' variables (Keras's arguments)."""
    return _on_chief(model, keras_evaluate, x, arguments)


def predict(model: Any, keras_predict: Any, x: Any = None, **arguments: Any) -> Any:
    """`model.predict` on the chief, reading the servers' variables (Keras's arguments)."""
    return _on_chief(model, keras_predict, x, arguments)


def _on_chief(model: Any, keras_method: Any, x: Any, arguments: dict[str, Any]) -> Any:
    """Runs Keras's `evaluate` or `predict` with the strategy set aside for the call:
    Keras then runs its own loop on this process, and each batch is seen exactly once."""
    if isinstance(x, tf.data.Dataset):
        _build(model, x)
    strategy = model._distribute_strategy
    model._distribute_strategy = None
    try:
        with _translated_cluster_errors(strategy):
            return keras_method(model, x, **arguments)
    finally:
        model._distribute_strategy = strategy


class _TrainFunctions:
    """The scheduled function for each count of steps, traced once per count.

    Args:
        model: The compiled model; each step is its own `train_step`.
        strategy: The model's ParameterServerStrategy.
    """

    def __init__(self, model: Any, strategy: tf.distribute.Strategy):
        self._model = model
        self._strategy = strategy
        self._functions: dict[int, Any] = {}

    def get(self, steps: int) -> Any:
        if steps not in self._functions:
            self._functions[steps] = tf.function(self._steps_function(steps))
        return self._functions[steps]

    def _steps_function(self, steps: int) -> Any:
        model, strategy = self._model, self._strategy

        def run_steps(iterator: Any) -> None:
            if steps == 1:
                strategy.run(model.train_step, args=(next(iterator),))
                return
            # The steps run in a graph loop on the worker, so one round trip to the
            # coordinator carries `steps` updates.
            for _ in tf.range(steps):
                strategy.run(model.train_step, args=(next(iterator),))

        return run_steps


def _per_worker_iterator(coordinator: Any, dataset: tf.data.Dataset,
                         strategy: tf.distribute.Strategy) -> Any:
    """Every worker's iterator over its share of `dataset`, repeated without end.

    The dataset's graph goes to each worker, which rebuilds it and keeps every
    n-th batch from its slot on: slots are handed out by a counter on a parameter
    server as workers build their copies, so the first n copies split the
    batches. A replaced worker takes the next slot, modulo n.
    """
    from tensorflow.python.distribute.coordinator import values

    num_workers = len(_cluster(strategy)["worker"])
    with strategy.scope():
        slots = tf.Variable(0, dtype=tf.int64, trainable=False, name="tfdist_input_slots")
    graph = values.serialize_dataset_to_graph(dataset)
    element_spec = dataset.element_spec

    def worker_dataset() -> tf.data.Dataset:
        copy = values.deserialize_dataset_from_graph(graph, element_spec)
        slot = slots.assign_add(1, read_value=True) - 1
        return copy.shard(num_workers, slot % num_workers).repeat()

    return iter(coordinator.create_per_worker_dataset(worker_dataset))


def _cluster(strategy: Any) -> dict[str, list[str]]:
    # ParameterServerStrategy keeps its resolver to itself (`strategy.cluster_resolver`
    # is None).
    return strategy._cluster_resolver.cluster_spec().as_dict()


def _count_each_step_once(iterations: Any, scheduled: int) -> None:
    """Sets `iterations` back to the steps scheduled if re-run steps counted twice."""
    counted = int(iterations.numpy())
    if counted > scheduled:
        logging.warning("tfdist: optimizer.iterations counted %d steps of %d scheduled: a "
                        "worker failed during a step, which ran again on another worker "
                        "(at-least-once); counting each step once.", counted, scheduled)
        iterations.assign(scheduled)


def _build(model: Any, dataset: tf.data.Dataset) -> None:
    """Creates the model's, metrics' and optimizer's variables on the parameter servers."""
    for batch in dataset.take(1):
        model._maybe_symbolic_build(data_batch=batch)


def _as_dataset(x: Any, y: Any, batch_size: int | None) -> tf.data.Dataset:
    if isinstance(x, tf.data.Dataset):
        return x
    if x is None or isinstance(x, (tf.distribute.DistributedDataset, Iterator)) \
            or callable(x):
        raise ConfigError("model.fit under parameter_server needs a batched tf.data.Dataset "
                          "(runner.dataset(...) returns one) or arrays with batch_size. "
                          f"Received: {type(x).__name__}")
    return tf.data.Dataset.from_tensor_slices(x if y is None else (x, y)).batch(
        batch_size or 32)


def _steps_per_epoch(dataset: tf.data.Dataset, steps_per_epoch: int | None) -> int:
    if steps_per_epoch is not None:
        if int(steps_per_epoch) < 1:
            raise ConfigError(f"steps_per_epoch must be an integer >= 1. "
                              f"Received: steps_per_epoch={steps_per_epoch!r}")
        return int(steps_per_epoch)
    cardinality = int(dataset.cardinality())
    if cardinality < 1:
        kind = {-1: "infinite", -2: "of unknown length"}.get(cardinality, "empty")
        raise ConfigError(f"model.fit under parameter_server needs steps_per_epoch for a "
                          f"dataset that is {kind}: workers repeat their data, so an epoch "
                          f"is a number of steps. Received: steps_per_epoch=None")
    return cardinality


@contextlib.contextmanager
def _translated_cluster_errors(strategy: Any) -> Iterator[None]:
    """Turns a parameter server's failure into one ClusterError line naming it."""
    from tensorflow.python.distribute.coordinator import cluster_coordinator

    try:
        yield
    except (tf.errors.UnavailableError, tf.errors.AbortedError,
            tf.errors.CancelledError) as error:
        if not cluster_coordinator._is_ps_failure(error):
            raise
        addresses = _cluster(strategy).get("ps", [])
        found = re.search(r"/job:ps/replica:\d+/task:(\d+)", str(error))
        if found and int(found.group(1)) < len(addresses):
            index = int(found.group(1))
            server, source = f"ps:{index} ({addresses[index]})", f" from {found.group(0)}"
        else:
            server, source = f"ps ({', '.join(addresses)})", ""
        raise ClusterError(f"parameter server {server} stopped answering, and its variables "
                           f"are gone: training cannot go on. Restart the cluster and resume "
                           f"from the last checkpoint. Received: {type(error).__name__}"
                           f"{source}") from None
