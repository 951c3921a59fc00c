"""The sharded optimizer: the user's optimizer class, holding and updating one rank's partition.

`sharded_optimizer(opt, collectives, stage)` returns an optimizer of `opt`'s class (a
subclass with the same name and module, so a saved model loads in plain Keras) whose
`build` creates state for the rank's pieces only (`tfdist.sharding.layout`) and whose
`apply` updates the pieces from the averaged gradients (stage 1) or from this rank's
slices of them, reduce-scattered in the backward pass (stages 2 and 3), and then
all-gathers the weights (stages 1 and 2).

Example:

    optimizer = sharded_optimizer(keras.optimizers.AdamW(1e-3), collectives, stage=2)
    model.compile(optimizer, "mse")
"""

from __future__ import annotations

import contextlib
from typing import Any, NamedTuple, Sequence

import keras
import numpy as np
import tensorflow as tf

from tfdist.errors import ConfigError
from tfdist.optimizers import named_as, recreated
from tfdist.patches.keras_optimizer import sum_repeated_rows
from tfdist.sharding.layout import Piece, ShardLayout
from tfdist.sharding.collectives import ShardCollectives
from tfdist.sharding import private
from tfdist.sharding.hooks import held
from tfdist.sharding.state import Other, ShardPart, Slot, plain_order
from tfdist.sharding.units import Gathering
from tfdist.sharding.weights import (gradient_is_sliced, gradient_shape, is_sharded,
                                     reduce_scattered, sharded_creation, whole_creation)

# The name of the weights' slices in a rank's shard file (`shard_state`, zero_stage 3).
WEIGHT = "tfdist_weight"
# The slot name of a gradient accumulator's slice in the shard files (zero_stage 3 with
# accumulation: `adopt_accumulators`).
ACCUMULATED = "tfdist_accumulated"

# Optimizers whose update of an element depends only on that element's gradient and
# state (and on scalars such as the step), so that a slice of a variable updates as
# the whole does. LAMB (a per-variable trust ratio), Adafactor (factored second
# moments) and Muon (orthogonalised matrices) are not.
ELEMENT_WISE = ("SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adadelta", "Adamax", "Nadam",
                "Lion", "Ftrl")


class SavedState(NamedTuple):
    """The whole state as of the end of a fit, for `model.save()` on the chief."""

    step: int  # `optimizer.iterations` then.
    full: dict[tuple[int, str], np.ndarray] | None  # Every slot whole; None off the chief.


class _Shard:
    """What a built sharded optimizer knows of its partition (a plain object, untracked)."""

    def __init__(self, variables: list[Any], layout: ShardLayout, owned: list[Piece]):
        self.variables = variables  # The model's trainable variables, in order.
        self.layout = layout
        self.owned = owned  # This rank's pieces.
        self.targets: list[Any] = []  # What the update writes, one per piece.
        self.slots: dict[tuple[int, str], Any] = {}  # (piece, slot name) -> variable.
        self.slot_names: list[str] = []
        # Piece index -> the wrapping optimizer's accumulator of that piece's gradient slice.
        self.accumulators: dict[int, Any] = {}
        self.plain: list[Slot | Other] = []  # `plain_order` of the unsharded optimizer.
        self.recording = False
        self.saved_state: SavedState | None = None  # Set at the end of each fit.
        # Built inside the first `apply` (a custom loop): that step's gradients were
        # computed whole, before the build made them reduce-scattered (zero_stage 2).
        self.whole_gradients_once = False
        with tf.init_scope():
            self.sink = tf.Variable(0.0, trainable=False, name="tfdist_zero_sink")
            self.zero = tf.Variable(0.0, trainable=False, name="tfdist_zero")


class _ShardedMixin:
    """Sharding, placed before the user's optimizer class in a subclass of it.

    What every stage does alike is here; what differs is in one subclass per stage
    (`STAGES`), each overriding the few methods that say how that stage stores, updates
    and gathers.
    """

    _collectives: ShardCollectives
    zero_stage: int  # The stage's number, for messages and the layout.
    # Updates slices of variables apart, as only an element-wise optimizer can.
    updates_slices: bool
    reduce_in_backward: bool

    def creation_scope(self, model: Any = None) -> contextlib.AbstractContextManager[None]:
        """Where `model`, built inside `fit` on its first batch (`tfdist.patches.
        keras_trainer`), creates its weights: as `runner.scope()` would have. Only stage 3
        stores them otherwise."""
        return contextlib.nullcontext()

    def build(self, var_list: Sequence[Any]) -> None:
        # Its own variables are whole, also where Keras builds it inside the creation
        # scope of a model built on its first batch (`creation_scope`).
        with whole_creation():
            self._build_shard(list(var_list))

    def _build_shard(self, variables: list[Any]) -> None:
        dtypes = sorted({keras.backend.standardize_dtype(v.dtype) for v in variables})
        if len(dtypes) > 1:
            raise ConfigError(f"zero_stage {self.zero_stage} shards variables of one dtype, but "
                              f"this model trains {', '.join(dtypes)} variables; use one "
                              f"variable dtype (a mixed_* policy keeps them float32), or "
                              f"zero_stage 0. Received: {dtypes}")
        self._check_storage(variables)
        layout = ShardLayout([int(np.prod(v.shape)) for v in variables],
                             self._collectives.size, self.zero_stage)
        # A plain object: the optimizer's attribute tracking would list the variables in it
        # (the model's among them) as the optimizer's own.
        self._shard = _Shard(variables, layout, layout.pieces(self._collectives.rank))
        with tf.init_scope():
            self._shard.targets = self._make_targets(variables)
        excluded = [target for piece, target in zip(self._shard.owned, self._shard.targets)
                    if not piece.whole and not self._use_weight_decay(variables[piece.variable])]
        if excluded and getattr(self, "weight_decay", None) is not None:
            self._exclude_from_weight_decay = set(getattr(
                self, "_exclude_from_weight_decay", set())) | {self._var_key(v) for v in excluded}
            self._exclude_from_weight_decay_cache = {}
        self._shard.recording = True
        try:
            super().build(self._shard.targets)
        finally:
            self._shard.recording = False
        self._shard.plain = plain_order(_users_class(type(self)), self.get_config(),
                                        len(variables))
        self._shard.slot_names = list(dict.fromkeys(entry.name for entry in self._shard.plain
                                                    if isinstance(entry, Slot)))
        if getattr(self, "_shard_trained_state", None) is not None:
            self.load_own_variables(self._shard_trained_state)
            self._shard_trained_state = None

    def add_variable_from_reference(self, reference_variable: Any, name: str | None = None,
                                    initializer: str = "zeros") -> Any:
        variable = super().add_variable_from_reference(reference_variable, name=name,
                                                       initializer=initializer)
        shard = getattr(self, "_shard", None)
        if shard is not None and shard.recording:
            index = next(i for i, target in enumerate(self._shard.targets)
                         if target is reference_variable)
            self._shard.slots[(index, name or "var")] = variable
        return variable

    def gradient_shape(self, variable: Any) -> tf.TensorShape:
        """The shape of `variable`'s gradient as `apply` receives it: this rank's slice
        where the backward pass reduce-scatters it."""
        return gradient_shape(variable)

    def adopt_accumulators(self, variables: Sequence[Any], accumulators: Sequence[Any]) -> None:
        """Makes the accumulators of gradients that reach this rank as slices part of its
        partition: checkpointed in its shard file, restored by element range on any
        number of ranks.

        A wrapping optimizer (`tfdist.accumulation.AccumulatingOptimizer`) calls it once
        built. Each such accumulator sums slices of the gradient already averaged across
        the ranks, which differ from rank to rank: a checkpoint's sum over the ranks of
        rank-local accumulators (`prepare_checkpoint`) would add up unrelated elements.
        Whole accumulators (stages 1 and 2, which reduce once per cycle) are left as they are.

        Args:
            variables: The variables the accumulators belong to, as `build` received them.
            accumulators: One accumulator per variable, of `gradient_shape(variable)`.
        """
        pieces = {piece.variable: i for i, piece in enumerate(self._shard.owned)}
        index_of = {id(variable): i for i, variable in enumerate(self._shard.variables)}
        self._shard.accumulators = {
            pieces[index_of[id(variable)]]: accumulator
            for variable, accumulator in zip(variables, accumulators)
            if gradient_is_sliced(variable)}

    @property
    def holds_accumulators(self) -> bool:
        """Whether gradient accumulators are part of this rank's partition
        (`adopt_accumulators`)."""
        return bool(getattr(self, "_shard", None) is not None and self._shard.accumulators)

    @property
    def sharded_variables(self) -> list[Any]:
        """The state this rank holds for its partition alone (other ranks hold the rest),
        adopted accumulators included."""
        shard = getattr(self, "_shard", None)
        return [] if shard is None else [*shard.slots.values(), *shard.accumulators.values()]

    @property
    def shard_rank(self) -> int:
        """This rank, in the partition."""
        return self._collectives.rank

    @property
    def shard_ranks(self) -> int:
        """The number of ranks the state is partitioned over."""
        return self._collectives.size

    @property
    def partition(self) -> list[Piece]:
        """The elements this rank updates."""
        return list(self._shard.owned)

    def apply(self, grads: Sequence[Any], trainable_variables: Sequence[Any] | None = None) -> None:
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
            self._shard.whole_gradients_once = True
        self._update(list(grads))

    def _update_targets(self, grads: list[Any]) -> None:
        """The user's optimizer's own update, of this rank's targets."""
        super().apply(grads, self._shard.targets)

    def finalize_variable_values(self, var_list: Sequence[Any]) -> None:
        """At the end of `fit` (every rank): EMA weights if asked, and the whole state to
        the chief, for `model.save()`."""
        if not self.built:
            return
        if getattr(self, "use_ema", False):
            if self._shard.owned:
                self._overwrite_model_variables_with_average_value(self._shard.targets)
            self._gather_weights()
        self._keep_whole_weights()
        # `model.save()` runs on the chief alone, where no collective can: the chief keeps
        # the whole state as of the end of this fit, in host memory (the others drop it).
        chief = self._collectives.rank == 0
        full = self.gather_full_state(keep=chief)
        self._shard.saved_state = SavedState(int(self.iterations.numpy()), full if chief else None)

    def save_own_variables(self, store: Any) -> None:
        """Writes the whole state, as the unsharded optimizer lists it (plain Keras loads it).

        Raises:
            ConfigError: not the chief, or the state changed since the end of the last fit.
        """
        step = int(self.iterations.numpy())
        saved = self._shard.saved_state if self.built else None
        if saved is None or saved.full is None or saved.step != step:
            raise ConfigError(f"a zero_stage {self.zero_stage} optimizer holds 1/N of its state "
                              f"on each rank, gathered to rank 0 at the end of each fit: save "
                              f"the model on rank 0 after fit returns (checkpoints during fit: "
                              f"runner.callbacks(checkpoint_dir=...)). Received: rank "
                              f"{self._collectives.rank}, step {step}")
        sharded = {id(v) for v in self.sharded_variables}
        others = [v for v in self.variables if id(v) not in sharded]
        for position, entry in enumerate(self._shard.plain):
            store[str(position)] = (saved.full[(entry.variable, entry.name)]
                                    if isinstance(entry, Slot) else others[entry.index].numpy())

    def load_own_variables(self, store: Any) -> None:
        """Sets this rank's part of the state from the whole state, as the unsharded
        optimizer lists it (a `.keras` or `.weights.h5` file's, or a trained optimizer's).

        Raises:
            ConfigError: not built yet, or the store lists another number of variables.
        """
        if not self.built:
            # Plain Keras warns and skips the state here; a sharded optimizer would fail
            # on its missing layout. Either way the saved state would be lost.
            raise ConfigError(f"this {type(self).__name__} is not built yet, so it has no "
                              f"place for saved state, which would be lost: resume from a "
                              f"checkpoint (runner.callbacks(checkpoint_dir=...)), which "
                              f"restores the state once fit has built the optimizer. "
                              f"Received: {len(store.keys())} saved variables")
        plain = self._shard.plain
        if len(store.keys()) != len(plain):
            raise ConfigError(f"the saved optimizer state has {len(store.keys())} variables, "
                              f"where this {type(self).__name__} built on these weights has "
                              f"{len(plain)}: load it into the model it was saved from, with "
                              f"the same optimizer. Received: {len(store.keys())} variables")
        sharded = {id(v) for v in self.sharded_variables}
        others = [v for v in self.variables if id(v) not in sharded]
        slots = {}
        for position, entry in enumerate(plain):
            value = np.asarray(store[str(position)])
            if isinstance(entry, Slot):
                slots[(entry.variable, entry.name)] = np.reshape(value, [-1])
            else:
                others[entry.index].assign(value)
        self.load_shard_state(lambda variable, name, start, stop:
                              slots[(variable, name)][start:stop])

    def _step(self) -> int:
        return int(self.iterations.numpy())

    def _global_scale(self, sum_of_squares: tf.Tensor) -> tf.Tensor:
        """Keras's `clip_by_global_norm` factor (NaN when the norm is not finite)."""
        norm = tf.sqrt(sum_of_squares)
        clip = tf.cast(self.global_clipnorm, norm.dtype)
        return clip * tf.minimum(1.0 / norm, 1.0 / clip) + (norm - norm)

    # --- what each stage does its own way (one subclass per stage below) --------------

    def _check_storage(self, variables: list[Any]) -> None:
        """Raises ConfigError where the model's variables are not stored as this stage needs."""

    def _make_targets(self, variables: list[Any]) -> list[Any]:
        """What the update writes, one variable per owned piece (in `tf.init_scope`)."""
        raise NotImplementedError

    def _update(self, grads: list[Any]) -> None:
        """One update from the step's gradients (one per variable, or None)."""
        raise NotImplementedError

    def _gather_weights(self) -> None:
        """Every rank's updated elements into every rank's variables (none at stage 3)."""

    def _keep_whole_weights(self) -> None:
        """At the end of a fit: what `model.save()` on the chief alone needs of the weights."""

    def _weight_parts(self) -> list[ShardPart]:
        """The weights' parts of this rank's shard file (at stage 3: its slices)."""
        return []

    def _load_weights(self, read: Any) -> list[tuple[Any, int, str]]:
        """Sets the weights saved in the shard files; returns those it leaves to be set
        like slots, as (variable, piece index, name)."""
        return []

    def gather_full_state(self, keep: bool = True) -> dict[tuple[int, str], np.ndarray]:
        """Every slot of every variable, whole (a collective: every rank calls it).

        In host memory (the CPU), so a rank holds at most one whole slot beyond its
        partition while it runs.

        Args:
            keep: Return what was gathered; False: take part only (an empty dict).
        """
        raise NotImplementedError

    # --- the whole state, and a rank's part of it -------------------------------------

    def shard_state(self) -> list[ShardPart]:
        """This rank's state: a `ShardPart` for each slot of each owned piece."""
        # At stage 3 a slot is padded beyond its piece; the padding is not state.
        parts = [ShardPart(piece.variable, name, piece.start, piece.stop,
                           np.reshape(self._shard.slots[(i, name)].numpy(),
                                      [-1])[:piece.stop - piece.start])
                 for i, piece in enumerate(self._shard.owned) for name in self._shard.slot_names
                 if (i, name) in self._shard.slots]
        for i, accumulator in self._shard.accumulators.items():
            piece = self._shard.owned[i]
            values = np.reshape(accumulator.numpy(), [-1])[:piece.stop - piece.start]
            parts.append(ShardPart(piece.variable, ACCUMULATED, piece.start, piece.stop, values))
        return parts + self._weight_parts()

    def load_shard_state(self, read: Any, weights: bool = False,
                         accumulated: bool = False) -> None:
        """Sets each owned slot from `read(variable, name, start, stop)` (flat values).

        Args:
            read: Reads elements [start, stop) of slot `name` of variable `variable`.
            weights: The files hold the weights too (saved at stage 3, where the chief's
                checkpoint has only its slice of each): set them. Saved at stage 1 or 2,
                the checkpoint had them whole.
            accumulated: The files hold the adopted accumulators (`adopt_accumulators`):
                set them. Otherwise they are left as they are.
        """
        owned = [(slot, i, name) for (i, name), slot in self._shard.slots.items()]
        if weights:
            owned += self._load_weights(read)
        if accumulated:
            owned += [(accumulator, i, ACCUMULATED)
                      for i, accumulator in self._shard.accumulators.items()]
        for slot, i, name in owned:
            piece = self._shard.owned[i]
            values = np.reshape(read(piece.variable, name, piece.start, piece.stop), [-1])
            padding = int(np.prod(slot.shape)) - values.size
            slot.assign(np.reshape(np.pad(values, (0, padding)), slot.shape))

    def _trackable_children(self, save_type: str = "checkpoint", **kwargs: Any) -> dict[str, Any]:
        # The chief writes the checkpoint: only what every rank holds alike (the step, the
        # learning rate) goes in it. The partitions go to each rank's own shard file
        # (`tfdist.resume.sharded_state`).
        children = super()._trackable_children(save_type, **kwargs)
        sharded = {id(v) for v in self.sharded_variables}
        return {name: child for name, child in children.items()
                if isinstance(child, keras.Variable) and id(child) not in sharded}


class _WholeVariables(_ShardedMixin):
    """Stage 1: whole variables dealt out to the ranks; gradients averaged, each rank
    updating the variables it owns in place and all-gathering them after."""

    zero_stage = 1
    updates_slices = False

    def _make_targets(self, variables: list[Any]) -> list[Any]:
        return [variables[piece.variable] for piece in self._shard.owned]

    def _update(self, grads: list[Any]) -> None:
        mine = self._stage1_gradients(grads)
        if self._shard.owned:
            self._update_targets(mine)
        else:
            self.iterations.assign_add(1)
        self._gather_weights()

    def _stage1_gradients(self, grads: list[Any]) -> list[Any]:
        present = [i for i, grad in enumerate(grads) if grad is not None]
        averaged = self._collectives.average([grads[i] for i in present]) if present else []
        for i, grad in zip(present, averaged):
            grads[i] = grad
        if getattr(self, "global_clipnorm", None):
            squares = [tf.reduce_sum(tf.square(_values(sum_repeated_rows(grads[i]))))
                       for i in present]
            scale = self._global_scale(tf.add_n(squares) if squares else tf.constant(0.0))
            grads = [None if g is None else _scaled(g, scale) for g in grads]
        if averaged:
            # Every rank must join the all-reduce of every gradient, its own or not, but
            # TensorFlow prunes an op whose result nothing reads (a control dependency did
            # not keep it), and the ranks would wait for each other for ever: a variable
            # reads one element of each.
            parts = [part for grad in averaged for part in (
                (grad.values, grad.indices) if isinstance(grad, tf.IndexedSlices) else (grad,))]
            self._shard.sink.assign(tf.add_n([
                tf.reduce_sum(tf.cast(tf.reshape(part, [-1])[:1], tf.float32)) for part in parts]))
        return [grads[piece.variable] for piece in self._shard.owned]

    def _gather_weights(self) -> None:
        gathered = self._collectives.concatenate(self._contribution(self._shard.targets))
        owned = {p.variable for p in self._shard.owned if p.whole}
        for index, variable in enumerate(self._shard.variables):
            if index not in owned:  # Updated in place already.
                where, size = self._shard.layout.position[index], self._shard.layout.sizes[index]
                variable.assign(tf.reshape(gathered[where:where + size], variable.shape))

    def _contribution(self, values: Sequence[Any]) -> tf.Tensor:
        """This rank's pieces of `values` (one per owned piece), flat and padded."""
        dtype = self._shard.variables[0].dtype if self._shard.variables else tf.float32
        flat = [tf.reshape(tf.cast(tf.convert_to_tensor(value), dtype), [-1]) for value in values]
        rank = self._collectives.rank
        padding = self._shard.layout.slice_size(rank) - sum(
            p.stop - p.start for p in self._shard.owned)
        # Zeros read from a variable, not a constant: a rank that owns nothing would
        # contribute a constant, and TensorFlow would fold its gather into the constant it
        # gives once, when the step is optimised; in the steps the rank would not join it.
        zeros = tf.fill([padding], tf.cast(self._shard.zero.read_value(), dtype))
        return tf.concat(flat + [zeros], 0)

    def gather_full_state(self, keep: bool = True) -> dict[tuple[int, str], np.ndarray]:
        full = {}
        for name in self._shard.slot_names:
            values = [self._shard.slots[(i, name)] for i in range(len(self._shard.owned))]
            with tf.device("/cpu:0"):
                gathered = self._collectives.concatenate(self._contribution(values)).numpy()
            if not keep:
                continue
            for index, variable in enumerate(self._shard.variables):
                where, size = self._shard.layout.position[index], self._shard.layout.sizes[index]
                full[(index, name)] = gathered[where:where + size].reshape(variable.shape)
        return full


class _SlicedMixin(_ShardedMixin):
    """Stages 2 and 3: an equal slice of each variable per rank, updated from this rank's
    slice of the averaged gradient (reduce-scattered)."""

    updates_slices = True

    def _sliced_gradients(self, grads: list[Any]) -> list[Any]:
        """Each variable's slice of the averaged gradient (reduce-scattered in the backward
        pass, `tfdist.sharding.weights`), clipped as one device clips the whole."""
        self._collectives.before_update()
        mine = [tf.zeros([width], variable.dtype) if grad is None else tf.convert_to_tensor(grad)
                for grad, width, variable in zip(grads, self._shard.layout.widths,
                                                 self._shard.variables)]
        if not mine:
            return mine
        if getattr(self, "global_clipnorm", None):
            scale = self._global_scale(self._collectives.sum(
                tf.add_n([tf.reduce_sum(tf.square(g)) for g in mine])))
            mine = [g * scale for g in mine]
        if getattr(self, "clipnorm", None):
            norms = tf.sqrt(self._collectives.sum(tf.stack([tf.reduce_sum(tf.square(g))
                                                            for g in mine])))
            mine = [g * self.clipnorm / tf.maximum(norms[i], self.clipnorm)
                    for i, g in enumerate(mine)]
        return mine

    def gather_full_state(self, keep: bool = True) -> dict[tuple[int, str], np.ndarray]:
        # Each slot of each variable gathered alone: a rank never holds a whole slot of
        # the model beyond its partition, only one variable's.
        full = {}
        for name in self._shard.slot_names:
            for index, variable in enumerate(self._shard.variables):
                with tf.device("/cpu:0"):
                    gathered = self._collectives.gather(
                        tf.convert_to_tensor(self._shard.slots[(index, name)]),
                        name=f"tfdist_zero_state_{index}_{name}").numpy()
                if keep:
                    size = self._shard.layout.sizes[index]
                    full[(index, name)] = gathered[:size].reshape(variable.shape)
        return full


class _SlicedGradients(_SlicedMixin):
    """Stage 2: the weights stay whole; their gradients come reduce-scattered from the
    backward pass (or, without `reduce_in_backward`, here, after it)."""

    zero_stage = 2

    def _make_targets(self, variables: list[Any]) -> list[Any]:
        # This rank's slice of each weight is updated in a copy, refreshed from the weight
        # before every update (the weight stays the truth: a broadcast or a restore
        # changes it under the optimizer).
        reduce_scattered(variables, self._collectives, self.reduce_in_backward)
        return [keras.Variable(held(variable).slice_of(variable.value, own_buffer=True),
                               name=variable.name, trainable=True) for variable in variables]

    def _update(self, grads: list[Any]) -> None:
        if self._shard.whole_gradients_once or not self.reduce_in_backward:
            self._shard.whole_gradients_once = False
            grads = [None if grad is None else held(variable).reduce_scatter_gradient(grad)
                     for grad, variable in zip(grads, self._shard.variables)]
        mine = self._sliced_gradients(grads)
        for variable, target in zip(self._shard.variables, self._shard.targets):
            target.assign(held(variable).slice_of(variable.value))
        self._update_targets(mine)
        self._gather_weights()

    def _gather_weights(self) -> None:
        # One variable at a time: the whole weights are never gathered at once.
        for index, (variable, target) in enumerate(zip(self._shard.variables,
                                                       self._shard.targets)):
            gathered = self._collectives.gather(tf.convert_to_tensor(target),
                                                name=f"tfdist_zero2_weight_{index}")
            variable.assign(tf.reshape(gathered[:self._shard.layout.sizes[index]],
                                       variable.shape))

    def _load_weights(self, read: Any) -> list[tuple[Any, int, str]]:
        for index, variable in enumerate(self._shard.variables):
            size = self._shard.layout.sizes[index]
            variable.assign(np.reshape(read(index, WEIGHT, 0, size), variable.shape))
        return []


class _SlicedWeights(_SlicedMixin):
    """Stage 3: the model's variables are stored as this rank's slices
    (`tfdist.sharding.weights`), which the update writes in place: nothing to gather."""

    zero_stage = 3
    gathering = Gathering()  # How the weights are gathered (`tfdist.sharding.units`).

    def creation_scope(self, model: Any = None) -> contextlib.AbstractContextManager[None]:
        return sharded_creation(self._collectives, self.gathering, model=model)

    def _check_storage(self, variables: list[Any]) -> None:
        _check_stored_sharded(variables)

    def _make_targets(self, variables: list[Any]) -> list[Any]:
        # Each variable's stored slice itself, under its name (weight decay's exclusions
        # go by name), updated in place.
        targets = [keras.Variable(held(v).shard, name=v.name, trainable=True)
                   for v in variables]
        for variable in variables:
            held(variable).version = self._step
        return targets

    def _update(self, grads: list[Any]) -> None:
        mine = self._sliced_gradients(grads)
        again = [held(variable).read_in_backward for variable in self._shard.variables]
        if any(again):
            mine = after_every_gradient(mine, again)
        self._update_targets(mine)

    def _keep_whole_weights(self) -> None:
        # `model.save()` and `get_weights()` on the chief alone read the whole weights:
        # each rank keeps them as of this step, in host memory, until the next update.
        step = self._step()
        for variable in self._shard.variables:
            weight = held(variable)
            with tf.device("/cpu:0"):
                weight.saved = (step, weight.read_value().numpy())

    def _weight_parts(self) -> list[ShardPart]:
        # The weights are this rank's slices: they go in the same file as its state.
        return [ShardPart(piece.variable, WEIGHT, piece.start, piece.stop,
                          target.numpy()[:piece.stop - piece.start])
                for piece, target in zip(self._shard.owned, self._shard.targets)]

    def _load_weights(self, read: Any) -> list[tuple[Any, int, str]]:
        return [(target, i, WEIGHT) for i, target in enumerate(self._shard.targets)]


def after_every_gradient(grads: list[Any], which: Sequence[bool]) -> list[Any]:
    """`grads`, those marked in `which` available only once every one of `grads` exists:
    the update of those weights then waits for the whole backward pass.

    A unit's recompute calls the units nested in it, which read their slices again in the
    backward pass (`tfdist.sharding.units`), and where no gradient of a nested unit's own
    weights depends on that read (a kernel's gradient does not read the kernel),
    TensorFlow's automatic control edge from the read to the slice's update is all that
    orders them. Grappler's dependency optimizer drops that edge when another path seems
    to join them through an IdentityN (a custom gradient's), which it then bypasses,
    leaving the read free to run after the update. Measured on a one-rank communicator
    (whose collectives are identities): a subclassed model holding nested units read an
    updated slice in 5 of 30 runs of 2,400 steps (three processes on two cores), none of
    30 with this barrier or 20 with Grappler off. Horovod's collectives, chained in step
    order, happen to keep the order; the barrier does not rely on them: the read feeds the
    gradients of the layers below, and the updates of the weights read again wait for
    those. The others update as soon as their own gradient exists: a barrier on every
    update would hold every slice's optimizer temporaries at once (measured: +0.4 bytes
    per parameter at the peak on 8 ranks, Adam).

    Args:
        grads: Each weight's gradient slice, or None.
        which: For each, whether its update must wait for every gradient: the weights
            whose slices a recompute reads again (`ShardedWeight.read_in_backward`).

    Example:

        mine = after_every_gradient(mine, [held(v).read_in_backward for v in variables])
    """
    present = [grad for grad in grads if grad is not None]
    with tf.control_dependencies(present):
        return [tf.identity(grad) if wait and grad is not None else grad
                for grad, wait in zip(grads, which)]


# The class that implements each stage.
STAGES: dict[int, type[_ShardedMixin]] = {1: _WholeVariables, 2: _SlicedGradients,
                                          3: _SlicedWeights}


def _check_stored_sharded(variables: Sequence[Any]) -> None:
    """Raises ConfigError unless every variable is stored sharded (created under
    `runner.scope()` at zero_stage 3)."""
    whole = [v.path for v in variables if not is_sharded(v)]
    if whole:
        raise ConfigError(f"zero_stage 3 stores each trainable variable as 1/N per rank from "
                          f"its creation, under runner.scope(), but {len(whole)} variable(s) "
                          f"were created outside it (a layer made before the scope): make "
                          f"the model and its layers inside runner.scope(). "
                          f"Received: {', '.join(whole[:3])}")


def _values(gradient: Any) -> Any:
    return gradient.values if isinstance(gradient, tf.IndexedSlices) else gradient


def _scaled(gradient: Any, scale: Any) -> Any:
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(gradient.values * scale, gradient.indices, gradient.dense_shape)
    return gradient * scale


def _sharded_class(base: type, stage: int) -> type:
    """`base` with the stage's sharding first: the same name and module, so Keras saves it
    as `base`."""
    return named_as(base, (STAGES[stage], base))


def _users_class(sharded: type) -> type:
    """The user's optimizer class that a sharded class (`_sharded_class`) derives from."""
    mro = sharded.__mro__
    return mro[mro.index(_ShardedMixin) + 1]


def check_stage(stage: int, optimizer: keras.optimizers.Optimizer) -> None:
    """Raises ConfigError for an optimizer the stage cannot shard exactly.

    Args:
        stage: 1, 2 or 3.
        optimizer: The user's optimizer.
    """
    name = type(optimizer).__name__
    element_wise = (name in ELEMENT_WISE
                    and type(optimizer).__module__.startswith("keras."))
    if STAGES[stage].updates_slices and not element_wise:
        raise ConfigError(f"zero_stage {stage} updates slices of variables, which only an "
                          f"element-wise optimizer ({', '.join(ELEMENT_WISE)}) updates as the "
                          f"whole; {name} is not one of them: use zero_stage 1, which updates "
                          f"every variable whole. Received: optimizer={name}, "
                          f"zero_stage={stage}")
    if getattr(optimizer, "gradient_accumulation_steps", None):
        raise ConfigError(f"zero_stage {stage} cannot shard Keras's own gradient_accumulation_"
                          f"steps; set tfdist's accumulation_steps instead. Received: "
                          f"gradient_accumulation_steps={optimizer.gradient_accumulation_steps}")


def sharded_optimizer(optimizer: keras.optimizers.Optimizer, collectives: ShardCollectives,
                      stage: int, reduce_in_backward: bool = True,
                      gathering: Gathering = Gathering()) -> keras.optimizers.Optimizer:
    """`optimizer`'s class and config, holding and updating only this rank's partition.

    Args:
        optimizer: The user's Keras optimizer: its config is taken, and its state where
            it is built (a trained optimizer, loaded from a `.keras` file, say).
        collectives: The ranks' communicator.
        stage: 1 (whole variables dealt out; gradients averaged), 2 (an equal slice
            of each variable per rank; gradients reduce-scattered in the backward pass,
            `tfdist.sharding.weights`) or 3 (as 2, with the model's variables stored
            as those slices).
        reduce_in_backward: At stage 2, reduce-scatter each gradient in the backward
            pass (True), or once per update, after it (False: with gradient
            accumulation, whose accumulators then stay whole and are checkpointed as
            without sharding). Stage 3 always reduces in the backward pass.
        gathering: At stage 3, the weights of a model built inside `fit` are created
            as `sharded_creation(collectives, gathering)` creates them
            (`creation_scope`): by default each layer's gathered again in its backward
            pass.

    Raises:
        ConfigError: an optimizer that is not element-wise at stage 2 (`ELEMENT_WISE`).

    Example:

        optimizer = sharded_optimizer(keras.optimizers.AdamW(1e-3), collectives, stage=2)
    """
    check_stage(stage, optimizer)
    private.check(stage)
    sharded = recreated(optimizer, _sharded_class(type(optimizer), stage))
    sharded._shard_trained_state = None
    if optimizer.built and optimizer.variables:
        # A trained optimizer (loaded from a `.keras` file, say): its state goes on, each
        # rank keeping its part when the sharded optimizer is built.
        sharded._shard_trained_state = {}
        optimizer.save_own_variables(sharded._shard_trained_state)
    sharded._collectives = collectives
    sharded.reduce_in_backward = reduce_in_backward or stage == 3
    if stage == 3:
        sharded.gathering = gathering
    return sharded


def find_sharded(optimizer: Any) -> Any:
    """The sharded optimizer in a chain of tfdist's wrappers, or None."""
    while optimizer is not None:
        if isinstance(optimizer, _ShardedMixin):
            return optimizer
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return None
