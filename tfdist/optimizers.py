"""Keras optimizer wrappers for gradients reduced outside `tf.distribute`.

Keras 3 computes gradients in its own train step and hands them to
`optimizer.apply`; it has no hook for a reduction it does not run itself (the
`DistributedOptimizer` of Horovod's Keras 2 integration overrides methods Keras 3
never calls). So the reduction lives in an optimizer that wraps the user's:

- `GradientReducingOptimizer` reduces the gradients with a given function (a
  Horovod allreduce, say), then lets the inner optimizer apply them.
- `AccumulatingOptimizer` sums micro-batch gradients on each replica and lets the
  inner optimizer apply (and reduce) their mean once per cycle.
- `AgreeingLossScaleOptimizer` is Keras's `LossScaleOptimizer` whose "are the
  gradients finite?" answer is reduced across replicas and processes first, so
  that all skip the same steps: none waits in a collective the others skipped,
  and none applies an inf another replica computed.

They compose as `AgreeingLossScaleOptimizer(AccumulatingOptimizer(
GradientReducingOptimizer(inner)))`, each present only when needed: gradients are
unscaled before they are accumulated, accumulated before they are reduced, and a
non-finite gradient on any replica skips the update on all of them.

Example:

    reducing = GradientReducingOptimizer(keras.optimizers.SGD(0.1), reduce_fn=allreduce)
    model.compile(optimizer=reducing, loss="mse")
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import keras
import tensorflow as tf

GradientReduceFn = Callable[[list[Any]], list[Any]]
FiniteReduceFn = Callable[[tf.Tensor], tf.Tensor]


class WrappingOptimizer(keras.optimizers.Optimizer):
    """Base of the wrappers: everything but `apply` is the inner optimizer's.

    Learning rate, iterations, slots, loss scaling and the config belong to the
    inner optimizer, so schedules and checkpoints see the optimizer the user built;
    the wrapper's own variables hold only what the wrapper itself needs.

    Args:
        inner_optimizer: The `keras.optimizers.Optimizer` that applies the updates.
        name: The optimizer's name.
    """

    def __init__(self, inner_optimizer: keras.optimizers.Optimizer, name: str | None = None,
                 **kwargs: Any):
        if kwargs:
            raise ValueError(f"{type(self).__name__} takes no optimizer arguments of its own; "
                             f"set them on the inner optimizer. Received: {sorted(kwargs)}")
        super().__init__(learning_rate=0.0, name=name)
        self.inner_optimizer = inner_optimizer

    def build(self, var_list: Sequence[Any]) -> None:
        self.inner_optimizer.build(var_list)
        super().build(var_list)

    def _build_if_needed(self, trainable_variables: Sequence[Any] | None) -> None:
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True

    @property
    def variables(self) -> list[Any]:
        return self._variables + self.inner_optimizer.variables

    @property
    def learning_rate(self) -> Any:
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate: Any) -> None:
        self.inner_optimizer.learning_rate = learning_rate

    @property
    def iterations(self) -> Any:
        return self.inner_optimizer.iterations

    def scale_loss(self, loss: Any) -> Any:
        return self.inner_optimizer.scale_loss(loss)

    def finalize_variable_values(self, var_list: Sequence[Any]) -> None:
        self.inner_optimizer.finalize_variable_values(var_list)

    def get_config(self) -> dict[str, Any]:
        # Only the name and the inner optimizer: the base class's options (clipping,
        # EMA, ...) belong to the inner optimizer, which applies the updates.
        return {"name": self.name,
                "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer)}

    @classmethod
    def from_config(cls, config: dict[str, Any], custom_objects: Any = None) -> Any:
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(config.pop("inner_optimizer"),
                                                      custom_objects=custom_objects)
        return cls(inner, **config)


@keras.saving.register_keras_serializable(package="tfdist")
class GradientReducingOptimizer(WrappingOptimizer):
    """Reduces gradients with `reduce_fn`, then applies them with the inner optimizer.

    Args:
        inner_optimizer: The `keras.optimizers.Optimizer` that applies the updates.
        reduce_fn: Takes the list of gradients that are not None (tensors or
            `tf.IndexedSlices`, in variable order) and returns their reductions in
            the same order. It runs inside the train step's `tf.function`, once per
            update, on every process.
        name: The optimizer's name.

    Example:

        optimizer = GradientReducingOptimizer(
            keras.optimizers.Adam(1e-3),
            reduce_fn=lambda grads: hvd.grouped_allreduce(grads, op=hvd.Average))
    """

    def __init__(self, inner_optimizer: keras.optimizers.Optimizer,
                 reduce_fn: GradientReduceFn | None = None, name: str | None = None,
                 **kwargs: Any):
        super().__init__(inner_optimizer, name=name, **kwargs)
        # None only after deserialisation: the reduction is a live function (bound to
        # a communicator) that a saved config cannot hold.
        self.reduce_fn = reduce_fn

    def apply(self, grads: Sequence[Any], trainable_variables: Sequence[Any] | None = None) -> None:
        self._build_if_needed(trainable_variables)
        self.inner_optimizer.apply(self.reduce(grads), trainable_variables=trainable_variables)

    def reduce(self, grads: Sequence[Any]) -> list[Any]:
        """Returns `grads` with every gradient that is not None reduced.

        Args:
            grads: One gradient (or None) per trainable variable.
        """
        if self.reduce_fn is None:
            raise ValueError(f"{self.name} has no reduce_fn: a deserialised "
                             f"{type(self).__name__} must be given one again")
        grads = list(grads)
        present = [index for index, grad in enumerate(grads) if grad is not None]
        reduced = self.reduce_fn([grads[index] for index in present]) if present else []
        if len(reduced) != len(present):
            raise ValueError(f"reduce_fn returned {len(reduced)} gradients for {len(present)}")
        for index, grad in zip(present, reduced):
            grads[index] = grad
        return grads


@keras.saving.register_keras_serializable(package="tfdist")
class AccumulatingOptimizer(WrappingOptimizer):
    """Sums `steps` micro-batches' gradients locally, then applies their mean once.

    Each replica adds its gradients to its own float32 accumulators (TensorFlow
    `ON_READ` variables: no communication when written). After `steps` calls, the
    inner optimizer applies the accumulated mean, and its own gradient reduction
    (tf.distribute's all-reduce, or a `GradientReducingOptimizer` inside) runs
    once for the `steps` micro-batches. Updates, `iterations` and learning-rate
    schedules count applied updates. A cycle carries over an epoch's end: the
    count runs over micro-batches, not epochs.

    Inside `AgreeingLossScaleOptimizer`, a non-finite micro-batch is not added, and
    its whole cycle is skipped (`skip_cycle`) on every replica.

    The accumulators and the count are optimizer variables, so checkpoints hold them
    and a resume in the middle of a cycle goes on where it stopped. Saved from
    several replicas, each accumulator holds their sum, which is restored split
    evenly; the update depends only on that sum, so it is the same.

    Args:
        inner_optimizer: The optimizer that applies the mean of each cycle.
        steps: Micro-batches per update (>= 1).
        name: The optimizer's name.

    Example:

        optimizer = AccumulatingOptimizer(keras.optimizers.SGD(0.1), steps=4)
        # model.fit with batch b now updates like batch 4b, every 4 steps
    """

    def __init__(self, inner_optimizer: keras.optimizers.Optimizer, steps: int = 1,
                 name: str | None = None, **kwargs: Any):
        super().__init__(inner_optimizer, name=name, **kwargs)
        if not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps must be an integer >= 1. Received: steps={steps!r}")
        self.steps = steps

    def build(self, var_list: Sequence[Any]) -> None:
        super().build(var_list)
        with keras.name_scope(self.name, caller=self):
            self._accumulators = [
                self._replica_local(variable.shape, "float32", "sum",
                                    f"{getattr(variable, 'path', variable.name)}_accumulated"
                                    .replace("/", "_").replace(":", "_"))
                for variable in var_list]
            self._micro_batches = self._replica_local((), "int64", "only_first_replica",
                                                      "micro_batches")
            self._cycle_skipped = self._replica_local((), "int64", "only_first_replica",
                                                      "cycle_skipped")

    def _replica_local(self, shape: Any, dtype: str, aggregation: str, name: str) -> Any:
        variable = keras.Variable(initializer="zeros", shape=shape, dtype=dtype,
                                  trainable=False, aggregation=aggregation,
                                  synchronization="on_read", name=name)
        self._track_variable(variable)
        return variable

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "steps": self.steps}

    def apply(self, grads: Sequence[Any], trainable_variables: Sequence[Any] | None = None) -> None:
        self._build_if_needed(trainable_variables)
        for accumulator, grad in zip(self._accumulators, grads):
            if grad is not None:
                accumulator.assign_add(tf.cast(tf.convert_to_tensor(grad), tf.float32))
        self._micro_batches.assign_add(1)
        self._end_cycle_if_complete(trainable_variables)

    def skip_cycle(self) -> None:
        """Counts a micro-batch that is not added, and skips the update of its cycle."""
        def skip() -> None:
            self._cycle_skipped.assign(1)
            self._micro_batches.assign_add(1)
            tf.cond(self._micro_batches.value >= self.steps, self._reset, _nothing)

        if tf.distribute.in_cross_replica_context():
            tf.distribute.get_strategy().extended.call_for_each_replica(skip)
        else:
            skip()

    def _end_cycle_if_complete(self, trainable_variables: Sequence[Any] | None) -> None:
        def decide(run: Callable[..., Any]) -> None:
            complete = self._micro_batches.value >= self.steps
            apply = tf.logical_and(complete, tf.equal(self._cycle_skipped.value, 0))
            def reset_if_complete() -> None:
                tf.cond(complete, lambda: run(self._reset), _nothing)

            tf.cond(apply, lambda: run(self._apply_and_reset, trainable_variables),
                    reset_if_complete)

        if tf.__internal__.distribute.strategy_supports_no_merge_call():
            decide(lambda fn, *args: fn(*args) and None)
        else:
            # A branch that reaches a merge_call (the inner optimizer's update does)
            # cannot sit in a cond in replica context under MirroredStrategy (the
            # failure of Keras's own accumulation, keras-team/keras#20582): decide in
            # cross-replica context, from the first replica's count (all are equal),
            # and run each branch back in every replica, as Keras's LossScaleOptimizer
            # does.
            def cross_replica(distribution: tf.distribute.Strategy) -> None:
                decide(lambda fn, *args: distribution.extended.call_for_each_replica(
                    fn, args=args) and None)

            tf.distribute.get_replica_context().merge_call(cross_replica)

    def _apply_and_reset(self, trainable_variables: Sequence[Any] | None = None) -> None:
        mean = [accumulator.value / float(self.steps) for accumulator in self._accumulators]
        self.inner_optimizer.apply(mean, trainable_variables=trainable_variables)
        self._reset()

    def _reset(self) -> None:
        for accumulator in self._accumulators:
            accumulator.assign(tf.zeros_like(accumulator.value))
        self._micro_batches.assign(0)
        self._cycle_skipped.assign(0)


def _nothing() -> None:
    """A cond branch that does nothing (tf.no_op would return an op the other lacks)."""


@keras.saving.register_keras_serializable(package="tfdist")
class AgreeingLossScaleOptimizer(keras.optimizers.LossScaleOptimizer):
    """Dynamic loss scaling whose skip decision is the same on every replica and process.

    Keras's `LossScaleOptimizer` checks each replica's own gradients before they
    are reduced. When one replica sees an inf and another does not, they disagree:
    across processes, the one that did not skip enters the gradient reduction alone
    and waits there for ever; under `MirroredStrategy`, Keras acts on the first
    replica's answer, applies the other replica's inf, and the weights become NaN.
    Here the local answer goes through `finite_reduce_fn` (an all-reduce) first, and
    a replica whose own gradients are finite gets a NaN added to one gradient when
    another's are not, so Keras's own check skips the step everywhere.

    Args:
        inner_optimizer: The optimizer to apply unscaled gradients with.
        finite_reduce_fn: Takes this replica's finiteness as a boolean scalar and
            returns whether the gradients are finite on every replica. It runs in
            replica context. None: the local answer, as in Keras.
        **kwargs: `initial_scale`, `dynamic_growth_steps`, `name`, as in Keras.

    Example:

        optimizer = AgreeingLossScaleOptimizer(
            inner, finite_reduce_fn=lambda ok: tf.cast(
                hvd.allreduce(tf.cast(ok, tf.int32), op=hvd.Min), tf.bool))
    """

    def __init__(self, inner_optimizer: keras.optimizers.Optimizer,
                 finite_reduce_fn: FiniteReduceFn | None = None, **kwargs: Any):
        super().__init__(inner_optimizer, **kwargs)
        self.finite_reduce_fn = finite_reduce_fn

    def apply(self, grads: Sequence[Any], trainable_variables: Sequence[Any] | None = None) -> None:
        if self.finite_reduce_fn is not None:
            grads = self._agreed(grads)
        super().apply(grads, trainable_variables)

    def _stateful_handle_non_finite_grads(self) -> None:
        super()._stateful_handle_non_finite_grads()
        if isinstance(self.inner_optimizer, AccumulatingOptimizer):
            self.inner_optimizer.skip_cycle()

    def _agreed(self, grads: Sequence[Any]) -> list[Any]:
        """`grads`, with a NaN in the first one when any replica's are not all finite."""
        grads = list(grads)
        present = [index for index, grad in enumerate(grads) if grad is not None]
        if not present:
            return grads
        everywhere = self.finite_reduce_fn(self.check_finite(grads))
        first = grads[present[0]]
        dtype = first.values.dtype if isinstance(first, tf.IndexedSlices) else first.dtype
        poison = tf.where(everywhere, tf.constant(0.0, dtype), tf.constant(float("nan"), dtype))
        if isinstance(first, tf.IndexedSlices):
            grads[present[0]] = tf.IndexedSlices(first.values + poison, first.indices,
                                                 first.dense_shape)
        else:
            grads[present[0]] = first + poison
        return grads
