"""Keras optimizer wrappers for gradients reduced outside `tf.distribute`.

Keras 3 computes gradients in its own train step and hands them to
`optimizer.apply`; it has no hook for a reduction it does not run itself (the
`DistributedOptimizer` of Horovod's Keras 2 integration overrides methods Keras 3
never calls). So the reduction lives in an optimizer that wraps the user's:

- `GradientReducingOptimizer` reduces the gradients with a given function (a
  Horovod allreduce, say), then lets the inner optimizer apply them.
- `AgreeingLossScaleOptimizer` is Keras's `LossScaleOptimizer` whose "are the
  gradients finite?" answer is reduced across replicas and processes first, so
  that all skip the same steps: none waits in a collective the others skipped,
  and none applies an inf another replica computed.

With `tfdist.accumulation.AccumulatingOptimizer` they compose as
`AgreeingLossScaleOptimizer(AccumulatingOptimizer(GradientReducingOptimizer(inner)))`,
each present only when needed: gradients are unscaled before they are accumulated,
accumulated before they are reduced, and a non-finite gradient on any replica skips
the update on all of them.

A trained model leaves tfdist whole: each wrapper is saved as what the user gave it
(`saved_as`). Its class bears the user's optimizer's name, module and registered name,
its config is that optimizer's, and the state it writes into a `.keras` file is that
optimizer's, in that optimizer's layout; the loss scale is saved as Keras's own
`LossScaleOptimizer`. So `model.save` writes a file that plain Keras loads, and loading
it gives the user's optimizer with its state: iterations, slots, the loss scale.
Accumulators are transient and stay out of the file (tfdist's checkpoints keep them).

Example:

    reducing = GradientReducingOptimizer(keras.optimizers.SGD(0.1), reduce_fn=allreduce)
    model.compile(optimizer=reducing, loss="mse")
    type(reducing).__name__, reducing.get_config()["learning_rate"]   # ('SGD', 0.1)
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import keras
import tensorflow as tf
from keras.src.saving import object_registration

GradientReduceFn = Callable[[list[Any]], list[Any]]
FiniteReduceFn = Callable[[tf.Tensor], tf.Tensor]


def recreated(optimizer: keras.optimizers.Optimizer,
              cls: type | None = None) -> keras.optimizers.Optimizer:
    """A new, unbuilt optimizer from `optimizer`'s config, weight-decay exclusions included.

    `exclude_from_weight_decay` (by variable or by name) is not in Keras's optimizer
    config, so `from_config` alone would silently decay what the user excluded.

    Args:
        optimizer: The optimizer to copy.
        cls: The class to build (a subclass of `optimizer`'s, say); default its own.

    Example:

        adamw = keras.optimizers.AdamW(1e-3, weight_decay=0.1)
        adamw.exclude_from_weight_decay(var_names=["bias"])
        fresh = recreated(adamw)  # an AdamW that still leaves the biases alone
    """
    made = (cls or type(optimizer)).from_config(optimizer.get_config())
    for name in ("_exclude_from_weight_decay", "_exclude_from_weight_decay_pattern"):
        if getattr(optimizer, name, None) is not None:
            setattr(made, name, getattr(optimizer, name))
    return made


_named: dict[tuple[type, tuple[type, ...]], type] = {}


def named_as(presented: type, bases: tuple[type, ...],
             namespace: dict[str, Any] | None = None) -> type:
    """A class of `bases` bearing `presented`'s name, module and Keras registered name.

    Keras saves an object under its class's name and module (`serialize_keras_object`
    reads `obj.__class__`), and loads it by them; a class made here is saved as
    `presented`, so a file written from its instances loads where only `presented`
    exists. Made once per (`presented`, `bases`).

    Args:
        presented: The class to be saved as (the user's optimizer's, say).
        bases: The new class's bases (a tfdist wrapper; or a mixin and `presented`).
        namespace: Further class attributes.

    Example:

        cls = named_as(keras.optimizers.Adam, (ShardingMixin, keras.optimizers.Adam))
        cls.__name__, cls.__module__   # ('Adam', 'keras.src.optimizers.adam')
    """
    key = (presented, bases)
    if key not in _named:
        made = type(presented.__name__, bases,
                    {"__module__": presented.__module__, "__qualname__": presented.__qualname__,
                     "__doc__": presented.__doc__, **(namespace or {})})
        registered = keras.saving.get_registered_name(presented)
        if registered != presented.__name__:
            # A user's own registered class ("package>Name"): saved under that name, so
            # that loading finds the user's class. Only the name table is written, never
            # the object table: loading still gives the user's class, not this one.
            object_registration.GLOBAL_CUSTOM_NAMES[made] = registered
        _named[key] = made
    return _named[key]


def user_optimizer(optimizer: keras.optimizers.Optimizer) -> keras.optimizers.Optimizer:
    """The optimizer the user gave, inside tfdist's wrappers (`optimizer` if none wraps it).

    Args:
        optimizer: An optimizer, wrapped by tfdist or not.

    Example:

        user_optimizer(AccumulatingOptimizer(keras.optimizers.SGD(0.1), steps=2))   # the SGD
    """
    while isinstance(optimizer, WrappingOptimizer):
        optimizer = optimizer.inner_optimizer
    return optimizer


def _saved_as(cls: type, presented: type) -> type:
    """`cls` saved as `presented`: its name and module, and `from_config` gives a `presented`."""
    def from_config(_, config: dict[str, Any], custom_objects: Any = None) -> Any:
        return keras.saving.deserialize_keras_object(
            {"module": presented.__module__, "class_name": presented.__name__,
             "registered_name": keras.saving.get_registered_name(presented), "config": config},
            custom_objects=custom_objects)

    return named_as(presented, (cls,), {"from_config": classmethod(from_config),
                                        "_saved_as": presented})


class WrappingOptimizer(keras.optimizers.Optimizer):
    """Base of the wrappers: everything but `apply` is the inner optimizer's.

    Learning rate, iterations, slots, loss scaling and the config belong to the
    inner optimizer, so schedules and checkpoints see the optimizer the user built;
    the wrapper's own variables hold only what the wrapper itself needs.

    Saved, a wrapper is the user's optimizer (`user_optimizer`): an instance's class is
    a subclass bearing that optimizer's name and module, `get_config` is its config, and
    the state written into a `.keras` file is its variables alone, in its order.

    Args:
        inner_optimizer: The `keras.optimizers.Optimizer` that applies the updates.
        name: The optimizer's name.
    """

    def __new__(cls, inner_optimizer: Any = None, *args: Any, **kwargs: Any):
        if inner_optimizer is not None and "_saved_as" not in cls.__dict__:
            cls = _saved_as(cls, type(user_optimizer(inner_optimizer)))
        return super().__new__(cls)

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

    def gradient_shape(self, variable: Any) -> Any:
        """The shape of `variable`'s gradient as `apply` receives it: the inner optimizer's
        (a ZeRO stage's slice of it), or the variable's own."""
        inner = getattr(self.inner_optimizer, "gradient_shape", None)
        return variable.shape if inner is None else inner(variable)

    def finalize_variable_values(self, var_list: Sequence[Any]) -> None:
        self.inner_optimizer.finalize_variable_values(var_list)

    def get_config(self) -> dict[str, Any]:
        # The user's optimizer's: the wrapper is saved as it (see the class docstring).
        return user_optimizer(self).get_config()

    @classmethod
    def from_config(cls, config: dict[str, Any], custom_objects: Any = None) -> Any:
        # A config of the form earlier tfdist versions saved ({"inner_optimizer", "name",
        # wrapper options}), so that their files still load where tfdist is imported.
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(config.pop("inner_optimizer"),
                                                      custom_objects=custom_objects)
        return cls(inner, **config)

    def save_own_variables(self, store: Any) -> None:
        # The user's optimizer's variables, in its order, as plain Keras loads them.
        user_optimizer(self).save_own_variables(store)

    def load_own_variables(self, store: Any) -> None:
        user_optimizer(self).load_own_variables(store)

    def __dir__(self) -> list[str]:
        # Keras's saving walks `dir()` for the objects to save beside this one; the chain
        # below is saved already (save_own_variables), once, as the user's optimizer.
        return [name for name in super().__dir__() if name != "inner_optimizer"]


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

    def __new__(cls, *args: Any, **kwargs: Any):
        # Saved as Keras's own LossScaleOptimizer around the user's optimizer.
        if "_saved_as" not in cls.__dict__:
            cls = _saved_as(cls, keras.optimizers.LossScaleOptimizer)
        return super().__new__(cls)

    def __init__(self, inner_optimizer: keras.optimizers.Optimizer,
                 finite_reduce_fn: FiniteReduceFn | None = None, **kwargs: Any):
        super().__init__(inner_optimizer, **kwargs)
        self.finite_reduce_fn = finite_reduce_fn

    def save_own_variables(self, store: Any) -> None:
        # Keras's LossScaleOptimizer's layout: its own variables, then the inner
        # optimizer's; here the user's, as they are saved (a sharded optimizer's whole).
        inner: dict[str, Any] = {}
        user_optimizer(self.inner_optimizer).save_own_variables(inner)
        values = [variable.numpy() for variable in self._variables]
        values += [inner[str(index)] for index in range(len(inner))]
        for index, value in enumerate(values):
            store[str(index)] = value

    def load_own_variables(self, store: Any) -> None:
        own = len(self._variables)
        for index, variable in enumerate(self._variables):
            variable.assign(store[str(index)])
        user_optimizer(self.inner_optimizer).load_own_variables(
            {str(index - own): store[str(index)] for index in range(own, len(store.keys()))})

    def apply(self, grads: Sequence[Any], trainable_variables: Sequence[Any] | None = None) -> None:
        if self.finite_reduce_fn is not None:
            grads = self._agreed(grads)
        super().apply(grads, trainable_variables)

    def _stateful_handle_non_finite_grads(self) -> None:
        super()._stateful_handle_non_finite_grads()
        # An accumulating inner optimizer skips the whole cycle of this micro-batch.
        skip_cycle = getattr(self.inner_optimizer, "skip_cycle", None)
        if skip_cycle is not None:
            skip_cycle()

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
