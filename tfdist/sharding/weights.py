"""Weights whose gradients are reduce-scattered in the backward pass (ZeRO stages 2 and 3).

At stage 2 a weight stays whole on every rank (`ReduceScatteredWeight`); at stage 3 each
rank holds 1/N of it (`ShardedWeight`). Either way a read of the weight in a step is an
op whose gradient is a reduce-scatter, so the backward pass gives each rank its
averaged slice of each gradient as soon as the layer's gradient exists: the whole
gradient of the model never exists at once.

Under `sharded_creation(collectives)`, each trainable variable a Keras layer creates
is stored on this rank as its slice only: the initial value is computed, made rank
0's (a broadcast), flattened, padded to N equal slices, and all but this rank's slice
dropped, one variable at a time, as DeepSpeed's `zero.Init` does. So the whole model
never exists on one rank.

The Keras variable stays the user's own (its name, path and shape are the whole
variable's); what it holds in place of its `tf.Variable` is a `ShardedWeight`. Every
read of it (a layer's `self.kernel` in its `call`) is an all-gather of the slices,
whose gradient is a reduce-scatter. The optimizer (`tfdist.sharding.optimizer`)
then updates the rank's slices in place; no weights are gathered after the update.

Example:

    with sharded_creation(collectives):
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
    model.layers[0].kernel.value        # a ShardedWeight; read in a step: all 32 elements
    model.layers[0].kernel.value.shard  # this rank's 16 (of 2 ranks)
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import tensorflow as tf
from tensorflow.python.eager import record

from tfdist.errors import ConfigError

from tfdist.sharding.collectives import ShardCollectives
from tfdist.sharding import private
from tfdist.sharding import hooks
from tfdist.sharding.hooks import held, replace_storage
from tfdist.sharding.layout import Slicing
from tfdist.sharding.units import Gathering, Unit, inside_a_unit


class _StoredWeight:
    """What a Keras variable holds in place of its `tf.Variable` when its reads differ.

    Keras reads a variable with `tf.convert_to_tensor` (a registered conversion calls
    `read_value`) and differentiates with respect to its `handle`; everything else a
    variable answers comes from `storage`, the `tf.Variable` that holds the bytes.
    """

    _should_act_as_resource_variable = True
    _prefix = "tfdist_zero"  # Names the collectives, with the variable's index.
    gradient_sliced = True  # Whether the backward pass gives this rank a slice.

    def __init__(self, storage: tf.Variable, collectives: ShardCollectives, index: int,
                 slicing: Slicing):
        self.storage = storage
        self._collectives = collectives
        self._index = index
        self.slicing = slicing  # How the weight and its gradient are cut across ranks.

    @property
    def collectives(self) -> ShardCollectives:
        """The ranks' communicator its collectives go through."""
        return self._collectives

    @property
    def index(self) -> int:
        """The variable's place in creation (stage 3) or among the trainable variables
        (stage 2): it names its collectives, identically on every rank."""
        return self._index

    @property
    def size(self) -> int:
        """Elements of the whole weight."""
        return self.slicing.size

    @property
    def width(self) -> int:
        """Elements of this rank's slice, padding included."""
        return self.slicing.width

    @property
    def dtype(self) -> tf.DType:
        return self.storage.dtype

    @property
    def name(self) -> str:
        return self.storage.name

    @property
    def trainable(self) -> bool:
        return self.storage.trainable

    @property
    def synchronization(self) -> tf.VariableSynchronization:
        return self.storage.synchronization

    @property
    def aggregation(self) -> tf.VariableAggregation:
        return self.storage.aggregation

    @property
    def device(self) -> str:
        return self.storage.device

    @property
    def handle(self) -> tf.Tensor:
        # What `tf.GradientTape.gradient` differentiates with respect to.
        return self.storage.handle

    @property
    def _shared_name(self) -> str:
        return self.storage._shared_name

    def value(self) -> tf.Tensor:
        return self.read_value()

    def read_value(self) -> tf.Tensor:
        raise NotImplementedError

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return np.asarray(self.numpy(), dtype=dtype)

    def reduce_scatter_gradient(self, upstream: Any) -> tf.Tensor:
        """This rank's averaged slice of the whole gradient `upstream` (a collective).

        A sparse gradient (an Embedding's rows) is summed into a dense one here: repeated
        rows add exactly, as one device's update adds them.
        """
        flat = tf.reshape(tf.convert_to_tensor(upstream), [-1])
        padded = tf.pad(flat, [[0, self.slicing.padded - self.size]])
        return self._collectives.reduce_scatter(
            padded, name=f"{self._prefix}_gradient_{self._index}")

    def slice_of(self, value: Any, own_buffer: bool = False) -> tf.Tensor:
        """This rank's slice of a whole value, flattened and padded with zeros to `width`;
        with `own_buffer`, in a buffer of its own (to make a variable from)."""
        return _slice(tf.cast(tf.convert_to_tensor(value), self.dtype), self.slicing,
                      self._collectives.rank, own_buffer)


class ReduceScatteredWeight(_StoredWeight):
    """What a Keras variable holds at zero_stage 2: the whole weight, whose gradient is
    reduce-scattered in the backward pass.

    Reading it is reading the weight; the gradient of the read is this rank's slice of
    the gradient averaged across ranks (`width` elements of the flattened, padded
    gradient), produced as soon as the layer's gradient exists. So the whole gradient of
    the model never exists at once, and no buffer of all gradients is built after the
    backward pass.

    Args:
        storage: The weight, a `tf.Variable` (whole).
        collectives: The ranks' communicator.
        index: The variable's place among the trainable variables: it names its
            reduce-scatter, identically on every rank.
        in_backward: False: reads are plain reads, and the gradient stays whole until
            the optimizer reduce-scatters it (`reduce_scatter_gradient`).

    Example:

        weight = ReduceScatteredWeight(keras_variable.value, collectives, 0)
        replace_storage(keras_variable, weight)    # what the sharded optimizer's build does
    """

    _prefix = "tfdist_zero2"

    def __init__(self, storage: tf.Variable, collectives: ShardCollectives, index: int,
                 in_backward: bool = True):
        super().__init__(storage, collectives, index,
                         Slicing(int(storage.shape.num_elements()), collectives.size))
        self.gradient_sliced = in_backward

    @property
    def shape(self) -> tf.TensorShape:
        return self.storage.shape

    @property
    def _unique_id(self) -> str:
        # The same key as the variable's: Keras's optimizer finds a variable's state by it.
        return self.storage._unique_id

    def read_value(self) -> tf.Tensor:
        if not self.gradient_sliced or not record.could_possibly_record():
            # No tape records this read (predict, evaluate, a SavedModel's trace): no
            # gradient, so no reduce-scatter in the graph (a served model has no Horovod).
            return self.storage.read_value()

        @tf.custom_gradient
        def whole(value: tf.Tensor) -> Any:
            return tf.identity(value), self.reduce_scatter_gradient

        return whole(self.storage.read_value())

    def numpy(self) -> np.ndarray:
        return self.storage.numpy()

    def assign(self, value: Any, use_locking: bool = False, name: str | None = None,
               read_value: bool = True) -> Any:
        return self.storage.assign(value, use_locking=use_locking, name=name,
                                   read_value=read_value)

    def _serialize_to_tensors(self) -> dict[str, Any]:
        return self.storage._serialize_to_tensors()

    def _restore_from_tensors(self, restored_tensors: dict[str, Any]) -> Any:
        value = restored_tensors["VARIABLE_VALUE"]
        if value.shape == self.shape:
            return self.storage.assign(value)
        # A slice (a checkpoint of zero_stage 3): the whole weight is in the shard files
        # (`load_shard_state`).
        return tf.no_op()

    def _export_to_saved_model_graph(self, object_map: Any, tensor_map: Any, options: Any,
                                     **kwargs: Any) -> list[Any]:
        # `model.export`: the SavedModel holds the whole weight, the variable it reads.
        handles = self.storage._export_to_saved_model_graph(object_map, tensor_map, options,
                                                            **kwargs)
        object_map[self] = object_map[self.storage]
        return handles

    def _write_object_proto(self, proto: Any, options: Any) -> None:
        self.storage._write_object_proto(proto, options)

    def __repr__(self) -> str:
        return (f"<ReduceScatteredWeight {self.name} shape={self.shape} gradient slice="
                f"{self.width} of {self._collectives.size} ranks>")


class ShardedWeight(_StoredWeight):
    """What a Keras variable holds at zero_stage 3 in place of its `tf.Variable`.

    `shard` is this rank's slice of the flattened variable, padded so that every rank's
    slice is `width` long. Reading it (`tf.convert_to_tensor`, which is how Keras reads
    its variables) gathers the whole value; the gradient of that read with respect to
    `shard` is this rank's slice of the gradient, averaged across ranks. Assigning a
    whole value stores this rank's slice of it.

    Args:
        shard: This rank's slice, a `tf.Variable` of shape `[width]`.
        shape: The whole variable's shape.
        collectives: The ranks' communicator.
        index: The variable's place in creation order: it names the variable's
            collectives, identically on every rank.

    Example:

        weight = keras_variable.value      # under sharded_creation
        weight.shard.shape                  # [ceil(size / N)]
        tf.convert_to_tensor(weight).shape  # the whole shape (a collective)
    """

    _prefix = "tfdist_zero3"

    def __init__(self, shard: tf.Variable, shape: tf.TensorShape, collectives: ShardCollectives,
                 index: int):
        whole_shape = tf.TensorShape(shape)
        super().__init__(shard, collectives, index,
                         Slicing(int(whole_shape.num_elements()), collectives.size))
        if shard.shape != [self.width]:
            raise ValueError(f"a slice of {self.width} elements holds 1/{collectives.size} of "
                             f"{whole_shape}. Received: {shard.shape}")
        self.shard = shard
        self.whole_shape = whole_shape
        # The whole value gathered at the end of a fit, for `model.save()` on the chief
        # alone, and the optimizer step it belongs to (`version()` is the current step).
        self.saved: tuple[int, np.ndarray] | None = None
        self.version: Callable[[], int] | None = None
        # The layer's unit (`tfdist.sharding.units`) that gathers this weight for its
        # calls; None: each read gathers.
        self.unit: Any = None
        # Whether a unit's recompute reads this weight's slice again in the backward pass
        # (a nested unit's weight, or one read by another layer inside a unit): its update
        # then waits for every gradient (`tfdist.sharding.optimizer.after_every_gradient`).
        self.read_in_backward = False

    @property
    def shape(self) -> tf.TensorShape:
        return self.whole_shape

    @property
    def _unique_id(self) -> str:
        return f"{self.shard._unique_id}_sharded"

    def read_value(self) -> tf.Tensor:
        """The whole value: inside its unit's call, the one the unit gathered; else a
        collective (every rank reads it, in the same order)."""
        if self.unit is not None:
            value = self.unit.value_of(self)
            if value is not None:
                return value
        if inside_a_unit():
            self.read_in_backward = True
        return self._gathered()

    def whole_from(self, piece: tf.Tensor, name: str) -> tf.Tensor:
        """The whole value gathered from every rank's `piece` (this rank's slice), by a
        collective named `tfdist_zero3_<name>`; differentiated by its caller."""
        gathered = self._collectives.gather(piece, name=f"tfdist_zero3_{name}")
        return tf.reshape(gathered[:self.size], self.whole_shape)

    def numpy(self) -> np.ndarray:
        """The whole value: the one saved at the end of the last fit while no step has run
        since (no collective: the chief saves the model alone), else a gather."""
        if self._saved_is_current():
            return self.saved[1]
        return self._gathered().numpy()

    def whole_value(self) -> np.ndarray:
        """The whole value kept at the end of the last fit, read with no collective (what
        `model.export` serves: tfdist.patches.keras_export).

        Raises:
            ConfigError: a step has run since the end of the last fit.
        """
        if not self._saved_is_current():
            raise ConfigError("model.export at zero_stage 3 exports the whole weights kept at "
                              "the end of fit: export after fit returns (on rank 0, say), "
                              f"before any other step. Received: the weight {self.name}, "
                              "changed since the last fit")
        return self.saved[1]

    def _saved_is_current(self) -> bool:
        return (self.saved is not None and self.version is not None
                and self.saved[0] == self.version())

    def assign(self, value: Any, use_locking: bool = False, name: str | None = None,
               read_value: bool = True) -> Any:
        """Stores this rank's slice of the whole `value` (every rank assigns the same)."""
        self.saved = None
        self.shard.assign(self.slice_of(value))
        return value

    def _gathered(self) -> tf.Tensor:
        @tf.custom_gradient
        def whole(piece: tf.Tensor) -> Any:
            return self.whole_from(piece, f"weight_{self._index}"), self.reduce_scatter_gradient

        return whole(self.shard.read_value())

    # --- checkpoints: each rank's slices are in its shard file (`tfdist.resume`) ---------

    def _serialize_to_tensors(self) -> dict[str, Any]:
        # The chief's checkpoint holds the chief's slice; every rank's own slice is in its
        # shard file, which a resume reads whatever the number of ranks.
        return self.shard._serialize_to_tensors()

    def _restore_from_tensors(self, restored_tensors: dict[str, Any]) -> Any:
        value = restored_tensors["VARIABLE_VALUE"]
        if value.shape == self.whole_shape:
            # The whole weight (a checkpoint of zero_stage 1 or 2): this rank's slice of it.
            return self.shard.assign(self.slice_of(value))
        # A slice (a checkpoint of zero_stage 3): the shard files restore this rank's.
        return tf.no_op()

    def _export_to_saved_model_graph(self, *args: Any, **kwargs: Any) -> list[Any]:
        # Reached only where Keras's `Model.export` runs without tfdist's patch (which
        # swaps in the whole weights first): every read here is a collective, which a
        # served model cannot run.
        raise ConfigError("a SavedModel of a zero_stage 3 model needs its whole weights: "
                          "call model.export under the horovod strategy's patches (a Runner "
                          "applies them), or save the model and export it in plain Keras. "
                          "Received: a ShardedWeight")

    def __repr__(self) -> str:
        return (f"<ShardedWeight {self.name} shape={self.whole_shape} slice={self.width} of "
                f"{self._collectives.size} ranks>")


def _slice(value: tf.Tensor, slicing: Slicing, rank: int, own_buffer: bool) -> tf.Tensor:
    """Rank `rank`'s slice of a whole value: flattened, cut, padded with zeros to `width`;
    with `own_buffer`, copied into a buffer of its own."""
    start, stop = slicing.bounds(rank)
    piece = tf.pad(tf.reshape(value, [-1])[start:stop], [[0, slicing.width - (stop - start)]])
    # A slice shares its whole value's buffer (TensorFlow's slice aliases it, and a pad of
    # nothing passes it through), and a variable made from it keeps that buffer alive: at
    # stage 3 every rank would hold the whole model (measured: 64.1 MiB after creating a
    # 64 MiB model as 1 of 4 ranks, against 18.9 MiB with the copy). An assign into an
    # existing variable copies anyway: no copy here.
    return tf.raw_ops.DeepCopy(x=piece) if own_buffer else piece


def _converted(weight: _StoredWeight, dtype: Any = None, name: str | None = None,
               as_ref: bool = False) -> tf.Tensor:
    del name, as_ref
    value = weight.read_value()
    return value if dtype is None or tf.as_dtype(dtype) == value.dtype else tf.cast(value, dtype)


tf.register_tensor_conversion_function(ShardedWeight, _converted)
tf.register_tensor_conversion_function(ReduceScatteredWeight, _converted)


# Names each sharded variable's collectives: every rank creates the same variables in the
# same order, so the k-th is the k-th on every rank.
_creation_order = itertools.count()
# Each layer's unit, made when the layer creates its first sharded weight.
_units: "weakref.WeakKeyDictionary[Any, Unit]" = weakref.WeakKeyDictionary()
# Set while `whole_creation()` runs on this thread.
_whole = threading.local()


def is_sharded(variable: Any) -> bool:
    """Whether a Keras variable (or what it holds) is stored sharded (zero_stage 3)."""
    return isinstance(held(variable), ShardedWeight)


def stored_variable(value: Any) -> Any:
    """The `tf.Variable` that holds a weight's bytes: a Keras variable's own, or at
    zero_stage 2 and 3 the one its storage keeps (at stage 3, this rank's slice). Takes a
    Keras variable or what one holds; any other value as it is."""
    value = held(value)
    return value.storage if isinstance(value, _StoredWeight) else value


def gradient_is_sliced(variable: Any) -> bool:
    """Whether the backward pass gives this rank a slice of `variable`'s gradient
    (zero_stage 2 and 3: reduce-scattered as the layer's gradient appears)."""
    value = held(variable)
    return isinstance(value, _StoredWeight) and value.gradient_sliced


def gradient_shape(variable: Any) -> tf.TensorShape:
    """The shape of `variable`'s gradient in the train step: this rank's slice at
    zero_stage 2 and 3 (the backward pass reduce-scatters it), else its own."""
    if gradient_is_sliced(variable):
        return tf.TensorShape([held(variable).width])
    return variable.shape


def reduce_scattered(variables: Sequence[Any], collectives: ShardCollectives,
                     in_backward: bool = True) -> list[Callable[[], None]]:
    """From now on, the gradients of these Keras variables are reduce-scattered, in the
    backward pass or when asked (`ReduceScatteredWeight`); their values stay whole.

    Every rank must pass the same variables in the same order (a model's
    `trainable_variables`).

    Args:
        variables: Keras variables (whole, or wrapped by an earlier call).
        collectives: The ranks' communicator.
        in_backward: Reduce-scatter in the backward pass; False: when the optimizer
            calls `reduce_scatter_gradient`.

    Returns:
        Each variable's undo (`tfdist.sharding.hooks.replace_storage`): it makes the
        variable hold again what it held before this call.

    Example:

        reduce_scattered(model.trainable_variables, collectives)  # zero_stage 2's build
    """
    return [replace_storage(variable, ReduceScatteredWeight(stored_variable(variable),
                                                            collectives, index, in_backward))
            for index, variable in enumerate(variables)]


@contextlib.contextmanager
def whole_creation() -> Iterator[None]:
    """Variables created inside are made whole, even under `sharded_creation`: the
    sharded optimizer's own (its targets, its stand-ins), built where Keras builds it,
    in the same scope as a model built on its first batch.

    Example:

        with sharded_creation(collectives):
            with whole_creation():
                step = keras.Variable(0)      # a plain variable on every rank
    """
    before = getattr(_whole, "active", False)
    _whole.active = True
    try:
        yield
    finally:
        _whole.active = before


@contextlib.contextmanager
def sharded_creation(collectives: ShardCollectives, gathering: Gathering = Gathering(),
                     model: Any = None) -> Iterator[None]:
    """Trainable variables created inside are stored as this rank's slice (`ShardedWeight`).

    Every rank must create the same variables in the same order (as data-parallel ranks
    building the same model do): each creation broadcasts rank 0's initial value.
    Non-trainable variables (BatchNormalization's statistics, metrics, optimizer state)
    are created as they would be.

    Args:
        collectives: The ranks' communicator.
        gathering: How the weights are gathered (`tfdist.sharding.units.Gathering`): by
            default each layer creating weights becomes a unit of them, whose call
            gathers them and drops them after, and whose backward pass gathers them
            again; with `regather=False` each read of a weight gathers it, and the
            gathered value lives until the backward pass has used it.
        model: The model being built inside, if any (one built on its first batch).

    Each weight joins its layer's unit when the scope ends: Keras may create a layer's
    variables after its `build`, when the outermost layer being built is done (a model
    built on its first batch, or a subclassed one built by a call), so the layer whose
    scope is open at the creation, or else `model`, is searched for the one that holds it.

    Example:

        with sharded_creation(collectives):
            model = build_model()
    """
    private.check(3)  # before any variable is made as a slice

    def creator(next_creator: Callable[..., Any], **kwargs: Any) -> Any:
        synchronization = kwargs.get("synchronization")
        if not kwargs.get("trainable", True) or synchronization in (
                tf.VariableSynchronization.ON_READ,) or getattr(_whole, "active", False):
            return next_creator(**kwargs)
        initial = kwargs["initial_value"]
        with tf.init_scope():
            value = tf.convert_to_tensor(initial() if callable(initial) else initial,
                                         dtype=kwargs.get("dtype"))
            index = next(_creation_order)
            value = collectives.broadcast(value, name=f"tfdist_zero3_initial_{index}")
            piece = _slice(value, Slicing(int(value.shape.num_elements()), collectives.size),
                           collectives.rank, own_buffer=True)
            shape = value.shape
            del value  # Only this rank's slice outlives the creation.
        arguments = {**kwargs, "initial_value": piece, "shape": None}
        with whole_creation():
            # An enclosing sharded_creation (a model built in fit called inside
            # runner.scope()) makes the slice as it is, not a slice of it.
            storage = next_creator(**arguments)
        weight = ShardedWeight(storage, shape, collectives, index)
        if gathering.regather:
            layers = hooks.layers_creating_variables()
            # The outermost layer named a unit (zero.unit) being built or called, else the
            # layer creating the variable.
            named = [layer for layer in layers if layer.name in gathering.unit]
            layer = named[0] if named else (layers[-1] if layers else None)
            created.append((weight, model if layer is None else layer))
        return weight

    created: list[tuple[ShardedWeight, Any]] = []
    with tf.variable_creator_scope(creator):
        yield
    owners = _unit_owners([layer for _, layer in created if layer is not None], gathering.unit)
    for weight, _ in created:
        if id(weight) in owners:  # else a variable no layer tracks: each read gathers it
            _join_unit(owners[id(weight)], weight, gathering)


def _unit_owners(searched: Sequence[Any], names: Sequence[str]) -> dict[int, Any]:
    """The layer whose unit each weight (by id) created in `searched` layers joins: the
    outermost layer named in `names` that holds it, else the layer that created it.

    Raises:
        ConfigError: a name matches none of the layers, or a named layer updates state of
            its own in its call (its recompute would update it twice).
    """
    owners: dict[int, Any] = {}
    named: dict[int, Any] = {}
    for root in {id(layer): layer for layer in searched}.values():
        for layer, weights in hooks.own_weights(root):
            owners.update({id(held(variable)): layer for variable in weights})
            if layer.name in names:
                named[id(layer)] = layer
    if not owners or not names:
        return owners
    missing = sorted(set(names) - {layer.name for layer in named.values()})
    if missing:
        raise ConfigError(f"zero.unit names layers that create no weights here: "
                          f"{', '.join(missing)}; name layers whose build or call creates "
                          f"weights under runner.scope() (model.summary() lists their names)")
    # An outer named layer holds every weight of a named one inside it: it goes last.
    for layer in sorted(named.values(), key=lambda layer: len(layer.trainable_variables)):
        if layer.non_trainable_variables:
            raise ConfigError(
                f"zero.unit names layer {layer.name!r}, which updates state of its own in its "
                f"call ({', '.join(v.path for v in layer.non_trainable_variables[:3])}): "
                f"the recompute of a unit would update it twice; name the layers inside it "
                f"that hold none, or leave zero.unit empty")
        owners.update({id(held(variable)): layer for variable in layer.trainable_variables})
    return owners


def _join_unit(layer: Any, weight: ShardedWeight, gathering: Gathering) -> None:
    """Makes `weight` one of the weights of `layer`'s unit (made and installed first)."""
    unit = _units.get(layer)
    if unit is None:
        unit = _units[layer] = Unit(layer, gathering)
        unit.install()
    unit.add(weight)
