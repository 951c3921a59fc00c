"""Gradient accumulation that works under every strategy, with one reduction per update.

Keras's own `gradient_accumulation_steps` puts the update in a cond in replica
context, which `MirroredStrategy` forbids (keras-team/keras#20582), and Horovod's
`backward_passes_per_step` exists only for Keras 2. `GradientAccumulator` holds the
accumulators and decides each cycle's end under any strategy; `AccumulatingOptimizer`
wraps the optimizer with it: each replica sums its micro-batch gradients locally, and
the inner optimizer applies (and reduces across replicas) their mean once per
cycle, as DDP's `no_sync` does.

Example:

    optimizer = AccumulatingOptimizer(keras.optimizers.SGD(0.1), steps=4)
    model.compile(optimizer, "mse")   # batch b now updates like batch 4b, every 4 steps
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import keras
import tensorflow as tf

from tfdist.optimizers import WrappingOptimizer


def accumulated_dtype(variable: Any) -> str:
    """The dtype a variable's gradients add up in: float64 for a float64 variable (a sum in
    float32 would round it), else float32 (a half-precision gradient's sum would overflow
    or round away, and a mixed policy's variables are float32 anyway)."""
    return "float64" if tf.as_dtype(variable.dtype) == tf.float64 else "float32"


class GradientAccumulator:
    """The accumulators and the cycle of gradient accumulation, for the optimizer that owns them.

    Each replica adds its micro-batch gradients to its own float32 accumulators (float64
    for a float64 variable; TensorFlow `ON_READ` variables: no communication when
    written). At the end of every `steps` micro-batches, `apply_fn` receives their mean
    (or sum) once, and whatever reduction it does runs once per cycle, as DDP's
    `no_sync` does. Used by
    `AccumulatingOptimizer` and by `tfdist.horovod.keras.DistributedOptimizer`
    (`backward_passes_per_step`).

    Args:
        steps: Micro-batches per update (>= 1).
        average: True: apply the mean of the micro-batches' gradients (a batch `steps`
            times larger). False: their sum (Horovod's default for
            `backward_passes_per_step`).

    Example:

        accumulator = GradientAccumulator(steps=4)
        accumulator.build(model.trainable_variables, make_variable)
        accumulator.add(grads, apply_fn=lambda mean: optimizer.apply(mean, variables))
    """

    def __init__(self, steps: int, average: bool = True):
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise ValueError(f"steps must be an integer >= 1. Received: steps={steps!r}")
        self.steps = steps
        self.average = average
        self.accumulators: list[Any] = []
        self.micro_batches: Any = None
        self.cycle_skipped: Any = None

    def build(self, var_list: Sequence[Any], make_variable: Callable[..., Any],
              gradient_shape: Callable[[Any], Any] | None = None) -> None:
        """Creates one accumulator per variable, and the cycle's counters.

        Args:
            var_list: The trainable variables, in the order gradients come.
            make_variable: `make_variable(shape, dtype, aggregation, name)` returns a
                replica-local (`synchronization="on_read"`) variable; the owner decides
                whether it is one of its tracked (saved) variables.
            gradient_shape: The shape of a variable's gradient as `add` receives it (a
                ZeRO stage's slice, say); default the variable's own.
        """
        shape_of = gradient_shape or (lambda variable: variable.shape)
        self.accumulators = [
            make_variable(shape_of(variable), accumulated_dtype(variable), "sum",
                          f"{getattr(variable, 'path', variable.name)}_accumulated"
                          .replace("/", "_").replace(":", "_"))
            for variable in var_list]
        self.micro_batches = make_variable((), "int64", "only_first_replica", "micro_batches")
        self.cycle_skipped = make_variable((), "int64", "only_first_replica", "cycle_skipped")

    @property
    def variables(self) -> list[Any]:
        return [*self.accumulators, self.micro_batches, self.cycle_skipped]

    def add(self, grads: Sequence[Any], apply_fn: Callable[[list[Any]], None]) -> None:
        """Adds one micro-batch's gradients; at the end of a cycle, applies and resets.

        Args:
            grads: One gradient (or None) per variable, in `build`'s order.
            apply_fn: Called (in replica context, inside a `tf.cond`) with the
                accumulated mean or sum, once per complete cycle that was not skipped.
        """
        for accumulator, grad in zip(self.accumulators, grads):
            if grad is not None:
                accumulator.assign_add(tf.cast(tf.convert_to_tensor(grad), accumulator.dtype))
        self.micro_batches.assign_add(1)
        self._end_cycle_if_complete(apply_fn)

    def skip_cycle(self) -> None:
        """Counts a micro-batch that is not added, and skips the update of its cycle."""
        def skip() -> None:
            self.cycle_skipped.assign(1)
            self.micro_batches.assign_add(1)
            tf.cond(self.micro_batches.value >= self.steps, self.reset, _nothing)

        if tf.distribute.in_cross_replica_context():
            tf.distribute.get_strategy().extended.call_for_each_replica(skip)
        else:
            skip()

    def reset(self) -> None:
        for accumulator in self.accumulators:
            accumulator.assign(tf.zeros_like(accumulator.value))
        self.micro_batches.assign(0)
        self.cycle_skipped.assign(0)

    def _end_cycle_if_complete(self, apply_fn: Callable[[list[Any]], None]) -> None:
        def apply_and_reset() -> None:
            scale = 1.0 / self.steps if self.average else 1.0
            apply_fn([accumulator.value * scale for accumulator in self.accumulators])
            self.reset()

        def decide(run: Callable[[Callable[[], None]], None]) -> None:
            complete = self.micro_batches.value >= self.steps
            apply = tf.logical_and(complete, tf.equal(self.cycle_skipped.value, 0))

            def reset_if_complete() -> None:
                tf.cond(complete, lambda: run(self.reset), _nothing)

            tf.cond(apply, lambda: run(apply_and_reset), reset_if_complete)

        if tf.__internal__.distribute.strategy_supports_no_merge_call():
            decide(lambda fn: fn() and None)
        else:
            # A branch that reaches a merge_call (the inner optimizer's update does)
            # cannot sit in a cond in replica context under MirroredStrategy (the
            # failure of Keras's own accumulation, keras-team/keras#20582): decide in
            # cross-replica context, from the first replica's count (all are equal),
            # and run each branch back in every replica, as Keras's LossScaleOptimizer
            # does.
            def cross_replica(distribution: tf.distribute.Strategy) -> None:
                decide(lambda fn: distribution.extended.call_for_each_replica(fn) and None)

            tf.distribute.get_replica_context().merge_call(cross_replica)


@keras.saving.register_keras_serializable(package="tfdist")
class AccumulatingOptimizer(WrappingOptimizer):
    """Sums `steps` micro-batches' gradients locally, then applies their mean once.

    Each replica adds its gradients to its own float32 (or float64) accumulators (a
    `GradientAccumulator`). After `steps` calls, the inner optimizer applies the
    accumulated mean, and its own gradient reduction (tf.distribute's all-reduce,
    or a `GradientReducingOptimizer` inside) runs once for the `steps`
    micro-batches. Updates, `iterations` and learning-rate schedules count applied
    updates. A cycle carries over an epoch's end: the count runs over
    micro-batches, not epochs.

    Inside `tfdist.optimizers.AgreeingLossScaleOptimizer`, a non-finite micro-batch
    is not added, and its whole cycle is skipped (`skip_cycle`) on every replica.

    The accumulators and the count are optimizer variables, so tfdist's checkpoints hold them
    and a resume in the middle of a cycle goes on where it stopped. Saved from
    several replicas, each accumulator holds their sum, which is restored split
    evenly; the update depends only on that sum, so it is the same. A `.keras` file
    (`model.save`) holds the user's optimizer alone, as plain Keras loads it: the
    accumulators of a cycle in progress are not in it.

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
        self._accumulator = GradientAccumulator(steps)
        self.steps = steps

    def build(self, var_list: Sequence[Any]) -> None:
        super().build(var_list)
        with keras.name_scope(self.name, caller=self):
            self._accumulator.build(var_list, self._replica_local, self.gradient_shape)
        # A ZeRO stage whose gradients reach each rank as slices keeps their accumulators
        # with its partition (`tfdist.sharding`'s `adopt_accumulators`).
        adopt = getattr(self.inner_optimizer, "adopt_accumulators", None)
        if adopt is not None:
            adopt(var_list, self._accumulator.accumulators)

    def _trackable_children(self, save_type: str = "checkpoint", **kwargs: Any) -> dict[str, Any]:
        # Accumulators the inner optimizer adopted are in each rank's shard file, not in
        # the chief's checkpoint (whose slices would not fit another number of ranks).
        # The others keep their names (their places in Keras's `_variables` list), so
        # the checkpoint reads the same on any number of ranks.
        children = super()._trackable_children(save_type, **kwargs)
        adopted = {id(variable)
                   for variable in getattr(self.inner_optimizer, "sharded_variables", ())}
        listed = children.get("_variables")
        if adopted and listed is not None:
            kept = getattr(self, "_checkpointed_variables", None)
            if kept is None:
                # Made once: a checkpoint knows its objects by identity. Set past Keras's
                # attribute tracking, which would add it as a child of its own.
                kept = tf.__internal__.tracking.wrap(
                    {str(i): variable for i, variable in enumerate(listed)
                     if id(variable) not in adopted})
                object.__setattr__(self, "_checkpointed_variables", kept)
            children["_variables"] = kept
        return children

    def _replica_local(self, shape: Any, dtype: str, aggregation: str, name: str) -> Any:
        variable = keras.Variable(initializer="zeros", shape=shape, dtype=dtype,
                                  trainable=False, aggregation=aggregation,
                                  synchronization="on_read", name=name)
        self._track_variable(variable)
        return variable

    @property
    def micro_batches(self) -> Any:
        """Micro-batches added in the current cycle (a variable)."""
        return self._accumulator.micro_batches

    def apply(self, grads: Sequence[Any], trainable_variables: Sequence[Any] | None = None) -> None:
        self._build_if_needed(trainable_variables)
        self._accumulator.add(grads, lambda mean: self.inner_optimizer.apply(
            mean, trainable_variables=trainable_variables))

    def skip_cycle(self) -> None:
        """Counts a micro-batch that is not added, and skips the update of its cycle."""
        self._accumulator.skip_cycle()


def _nothing() -> None:
    """A cond branch that does nothing (tf.no_op would return an op the other lacks)."""
