"""ZeRO stage 3's units: a layer's weights gathered for its call, dropped after it, and
gathered again in the backward pass (FSDP's `reshard_after_forward`).

At stage 3 each rank stores 1/N of every weight (`ShardedWeight`). A plain read of one
is an all-gather whose result the backward pass needs (the layer's gradient reads the
weight), so TensorFlow keeps every gathered weight from its forward use to its
backward one: at the peak each rank holds the whole model's weights. A unit breaks that
chain. Each layer that creates trainable weights under `sharded_creation` is a unit of
its own weights, and its call runs under a custom gradient:

- forward: gather the unit's weights (after its inputs exist, so that the gathers do
  not all fire at the step's start), call the layer, drop the gathered copies;
- backward: gather them again (after the incoming gradient exists), recompute the
  layer's forward under a tape of its own, return its inputs' gradients, and
  reduce-scatter each weight's gradient to this rank's slice.

The recompute must replay the forward exactly. A layer with non-trainable variables
(BatchNormalization's statistics, a Dropout's or any random layer's seed state) updates
them in its call, and a second call would update them again or draw other numbers, so
such a layer is no unit: its weights are read as before, one gather held from forward
to backward. A unit whose traced call still holds a stateful op (a TensorFlow random op,
a variable's assign) is refused with one line naming it.

The recompute costs about one more forward pass of each unit. A weight read by another
layer than its own (a tied embedding) is gathered for that read alone, as before.

Prefetch (`prefetch` units ahead, FSDP's forward and backward prefetch): the outermost
unit calls of a traced forward pass are noted in call order. A call's forward gather
waits for the inputs of the call `prefetch` places before it, not its own, so it runs
while those calls compute; in the backward pass, the backward of each call also issues
the gathers of the `prefetch` calls before it (after its own incoming gradient), which
their backward then takes. Every rank traces the same calls, so the ranks issue the same
collectives in the same order (`tfdist.horovod.ordering`); each one ahead holds one more
unit's whole weights.

Buckets (`bucket_bytes`, DeepSpeed's `stage3_prefetch_bucket_size` and
`reduce_bucket_size`): a unit's weights are gathered in one collective per bucket, each
rank's slices of them side by side, and their gradients reduce-scattered the same way,
in place of one collective per weight. Collectives run one after another in a step
(`tfdist.horovod.ordering`), so each one fewer is one negotiation fewer; the price is a
copy of the bucket when it is cut back into its weights.

Example:

    with sharded_creation(collectives, Gathering(prefetch=1)):
        model = build_model()      # each Dense is a unit of its kernel and bias
    units_of(model)                # [<Unit dense: 2 weights, sharded>, ...]
"""

from __future__ import annotations

import dataclasses
import enum
import threading
import weakref
from typing import Any, Callable, Sequence

import tensorflow as tf
from tensorflow.python.eager import record

from tfdist.errors import ConfigError
from tfdist.sharding import hooks

# TensorFlow ops whose second run differs from their first: random draws from a hidden
# state, and writes to variables. A unit's recompute replays its forward, so its call
# must hold none of them.
_STATEFUL_OPS = frozenset({
    "RandomUniform", "RandomUniformInt", "RandomStandardNormal", "TruncatedNormal",
    "RandomGamma", "RandomPoisson", "RandomPoissonV2", "RandomShuffle", "Multinomial",
    "ParameterizedTruncatedNormal", "StatefulUniform", "StatefulUniformInt",
    "StatefulUniformFullInt", "StatefulStandardNormalV2", "StatefulTruncatedNormal",
    "RngSkip", "RngReadAndSkip", "AssignVariableOp", "AssignAddVariableOp",
    "AssignSubVariableOp", "ResourceScatterUpdate", "ResourceScatterAdd"})


@dataclasses.dataclass(frozen=True)
class Gathering:
    """How zero_stage 3 gathers each layer's weights: the `zero:` config section.

    Attributes:
        regather: Each layer that creates weights is a unit of them (`Unit`), gathered
            for its call, dropped after it, and gathered again in its backward pass.
            False: each read of a weight gathers it, and the gathered value lives until
            the backward pass has used it.
        prefetch: With `regather`, how many outermost unit calls ahead each unit's
            weights are gathered; 0: its gathers wait for its own input and incoming
            gradient.
        bucket_bytes: With `regather`, a unit's weights go in one collective each way
            while their float32 bytes together stay within this many (a larger weight
            goes alone); 0: one collective per weight.
        unit: With `regather`, names of layers that are each one unit of every weight
            inside them (their own and their inner layers'), gathered for the layer's
            call as a whole (FSDP's `fully_shard` of a block); the layers outside them
            stay units of their own weights. Empty: each layer that creates weights is a
            unit of them.

    Example:

        with sharded_creation(collectives, Gathering(prefetch=1, bucket_bytes=16 << 20)):
            model = build_model()
    """

    regather: bool = True
    prefetch: int = 0
    bucket_bytes: int = 0
    unit: tuple[str, ...] = ()


def buckets(sizes: Sequence[int], bucket_bytes: int) -> list[list[int]]:
    """`sizes` (bytes, in order) cut into runs of consecutive indices whose bytes stay
    within `bucket_bytes`; a size over it is a run of its own, and 0 makes each its own.

    Example:

        buckets([400, 40, 400, 40], 500)   # [[0, 1], [2, 3]]
    """
    runs: list[list[int]] = []
    total = 0
    for index, size in enumerate(sizes):
        if runs and total + size <= bucket_bytes:
            runs[-1].append(index)
            total += size
        else:
            runs.append([index])
            total = size
    return runs


class _Tracing(threading.local):
    """How many unit bodies (a forward call, or a backward pass's recompute) are being
    traced now: a unit called inside one is nested, and gathers for itself alone."""

    depth = 0


_tracing = _Tracing()


def inside_a_unit() -> bool:
    """Whether a unit's body (its forward call, or its backward pass's recompute) is being
    traced now: a slice read here is read again in the backward pass, by the recompute."""
    return _tracing.depth > 0


@dataclasses.dataclass(eq=False)
class _Call:
    """One outermost call of a unit in a traced forward pass: what its backward pass, or
    a later call's backward pass prefetching for it, gathers from."""

    unit: "Unit"
    shards: list[tf.Tensor]  # this rank's slices, read for the call
    inputs: list[tf.Tensor]  # its floating inputs: a gather that waits for them
    dtype: Any  # the dtype its weights are gathered in
    prefetched: list[tf.Tensor] | None = None  # its backward gather, issued ahead
    backward_traced: bool = False


def _forward_calls(graph: Any) -> list[_Call]:
    """The outermost unit calls traced in `graph`'s forward pass so far, in call order.

    Kept on the graph itself: they die with it (a dictionary keyed by the graph would keep
    it alive through the tensors it holds)."""
    calls = getattr(graph, "_tfdist_unit_calls", None)
    if calls is None:
        calls = []
        graph._tfdist_unit_calls = calls
    return calls


class UnitState(enum.Enum):
    """Where a unit's weights are: as this rank's slices, or gathered whole for a call."""

    SHARDED = "sharded"
    GATHERED = "gathered"


class Unit:
    """One layer's own sharded weights, gathered for each of its calls and after it
    dropped; its backward pass gathers them again and recomputes the call.

    Created by `sharded_creation` for each layer that creates a trainable weight there;
    its call wrapper is installed with `tfdist.sharding.hooks.wrap_call` and undone by
    `undo()`.

    Args:
        layer: The Keras layer.
        gathering: How far ahead its weights are gathered (`prefetch`), and in how many
            collectives (`bucket_bytes`).

    Example:

        unit = Unit(layer, Gathering(prefetch=1))
        unit.add(weight)       # a ShardedWeight the layer created
        unit.install()         # from now on, the layer's calls gather, call and drop
    """

    def __init__(self, layer: Any, gathering: Gathering = Gathering()):
        self._layer = weakref.ref(layer)
        self.name = layer.name
        self.prefetch = gathering.prefetch
        self.bucket_bytes = gathering.bucket_bytes
        self.weights: list[Any] = []  # ShardedWeights, in creation order.
        self.state = UnitState.SHARDED
        self._values: dict[int, tf.Tensor] = {}  # id(weight) -> its gathered value.
        self._undo: Callable[[], None] | None = None
        self.checked_graphs: "weakref.WeakSet[Any]" = weakref.WeakSet()

    def add(self, weight: Any) -> None:
        """Makes `weight` (a ShardedWeight the layer created) one of the unit's."""
        self.weights.append(weight)
        weight.unit = self

    def install(self) -> None:
        """Wraps the layer's call (once)."""
        if self._undo is None:
            self._undo = hooks.wrap_call(self._layer(), self._call)

    def undo(self) -> None:
        """The layer calls as before: each read of a weight is a gather held to its backward."""
        if self._undo is not None:
            self._undo()
            self._undo = None
        for weight in self.weights:
            weight.unit = None

    @property
    def recomputed(self) -> bool:
        """Whether its traced calls gather, call and drop, and its backward passes gather
        again and recompute: a layer with variables of its own that are not trained
        (BatchNormalization's statistics, a seed's state) updates them in its call, so its
        weights are read as before, each gather held from forward to backward."""
        layer = self._layer()
        return layer is not None and not layer.non_trainable_variables

    def value_of(self, weight: Any) -> tf.Tensor | None:
        """The gathered value of `weight` while the unit is gathered, else None (a read
        outside the unit's call gathers for itself)."""
        if self.state is UnitState.GATHERED:
            return self._values.get(id(weight))
        return None

    def _buckets(self) -> list[list[int]]:
        """The unit's weights (indices in `weights`) in the groups each collective moves."""
        return buckets([weight.size * weight.dtype.size for weight in self.weights],
                       self.bucket_bytes)

    def _gathered(self, shards: Sequence[tf.Tensor], after: Sequence[tf.Tensor],
                  direction: str, dtype: Any = None) -> list[tf.Tensor]:
        """Each weight's whole value, gathered once every tensor in `after` exists, one
        collective per bucket; in `dtype` where given (each slice cast before the gather,
        as Keras casts the whole weight: the same values, in fewer bytes moved and held)."""
        pieces = [shard if dtype is None else tf.cast(shard, dtype) for shard in shards]
        values: list[tf.Tensor] = [None] * len(self.weights)
        with tf.control_dependencies([t for t in after if t is not None]):
            for bucket in self._buckets():
                gathered = gather_bucket([self.weights[i] for i in bucket],
                                         [pieces[i] for i in bucket],
                                         f"unit_{direction}_{self.weights[bucket[0]].index}")
                for i, value in zip(bucket, gathered):
                    values[i] = value
        return values

    def _reduce_scattered(self, grads: Sequence[tf.Tensor | None]) -> list[tf.Tensor | None]:
        """This rank's averaged slice of each weight's gradient, one collective per bucket
        of the weights that have one."""
        sliced: list[tf.Tensor | None] = [None] * len(self.weights)
        for bucket in self._buckets():
            present = [i for i in bucket if grads[i] is not None]
            if present:
                reduced = reduce_scatter_bucket(
                    [self.weights[i] for i in present],
                    [tf.cast(grads[i], self.weights[i].dtype) for i in present])
                for i, value in zip(present, reduced):
                    sliced[i] = value
        return sliced

    def _calling(self, call: Callable[..., Any], values: Sequence[tf.Tensor],
                 args: Any, kwargs: Any) -> Any:
        """`call(*args, **kwargs)` with the unit's weights read as `values`."""
        self._values = {id(w): value for w, value in zip(self.weights, values)}
        self.state = UnitState.GATHERED
        try:
            return call(*args, **kwargs)
        finally:
            self.state = UnitState.SHARDED
            self._values = {}

    def _call(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        layer = self._layer()
        if (not record.could_possibly_record() or tf.executing_eagerly()
                or self.state is UnitState.GATHERED or not self.recomputed):
            # No tape (inference, a symbolic call), eager code (a debugging step), the
            # unit's own call nested in itself, or state the recompute would update twice:
            # the weights are read as before.
            return call(*args, **kwargs)
        structure = (args, kwargs)
        flat = tf.nest.flatten(structure)
        # Only floating tensors are differentiated through; the others (token ids, masks)
        # reach the recompute as they are.
        where = [i for i, item in enumerate(flat)
                 if tf.is_tensor(item) and item.dtype.is_floating]

        def rebuilt(tensors: Sequence[tf.Tensor]) -> tuple[Any, Any]:
            items = list(flat)
            for i, tensor in zip(where, tensors):
                items[i] = tensor
            return tf.nest.pack_sequence_as(structure, items)

        count = len(where)
        graph = tf.compat.v1.get_default_graph()
        # The recompute runs outside Keras's `__call__`: it re-enters the dtype the
        # forward read the weights in and the `training` its inner layers inherited.
        keras_state = hooks.keras_call_state()
        # Under a mixed policy the call reads its weights in the compute dtype: gathered in
        # it (FSDP's `param_dtype`), the whole copies take half the bytes of float32. The
        # slices, the optimizer state and the reduce-scatter of each gradient stay float32.
        gather_dtype = hooks.autocast_dtype(layer)
        # A nested call (inside another unit's call or recompute) gathers for itself alone,
        # and reads its slices again in the outer unit's recompute (`read_in_backward`).
        nested = inside_a_unit()
        ahead = 0 if nested else self.prefetch
        if nested:
            for weight in self.weights:
                weight.read_in_backward = True

        @tf.custom_gradient
        def unit_call(*tensors: tf.Tensor) -> Any:
            inputs, shards = tensors[:count], tensors[count:]
            first_op = len(graph.get_operations())
            a, k = rebuilt(inputs)
            after, calls, this = inputs, [], None
            if ahead:
                calls = _forward_calls(graph)
                this = _Call(self, list(shards), list(inputs), gather_dtype)
                calls.append(this)
                # Prefetch: the gather may start as soon as the call `ahead` places before
                # this one has its inputs, while that call (and those after it) compute.
                after = calls[max(0, len(calls) - 1 - ahead)].inputs
            _tracing.depth += 1
            try:
                outputs = self._calling(
                    call, self._gathered(shards, after, "forward", gather_dtype), a, k)
            finally:
                _tracing.depth -= 1
            self._check_replayable(graph, first_op)

            def grad(*upstream: tf.Tensor, variables: Sequence[Any] | None = None) -> Any:
                variables = list(variables or [])
                # A backward traced in another graph (a loop's gradient) prefetches nothing.
                planned = this is not None and tf.compat.v1.get_default_graph() is graph
                if planned and this.prefetched is not None:
                    again, this.prefetched = this.prefetched, None
                else:
                    again = self._gathered(shards, upstream, "backward", gather_dtype)
                if planned:
                    this.backward_traced = True
                    position = calls.index(this)
                    # Backward prefetch: the calls before this one, nearest first, gathered
                    # while this one's backward computes.
                    for earlier in reversed(calls[max(0, position - ahead):position]):
                        if earlier.prefetched is None and not earlier.backward_traced:
                            earlier.prefetched = earlier.unit._gathered(
                                earlier.shards, upstream, "backward", earlier.dtype)
                _tracing.depth += 1
                try:
                    with tf.GradientTape() as tape, keras_state():
                        tape.watch([*inputs, *again])
                        a, k = rebuilt(inputs)
                        recomputed = self._calling(call, again, a, k)
                finally:
                    _tracing.depth -= 1
                targets = tf.nest.flatten(recomputed)
                sources = [*inputs, *again, *variables]
                grads = tape.gradient(targets, sources, output_gradients=list(upstream))
                # Each weight's gradient as this rank's averaged slice, as soon as it exists.
                sliced = self._reduce_scattered(grads[count:count + len(again)])
                return [*grads[:count], *sliced], list(grads[count + len(again):])

            return outputs, grad

        return unit_call(*[flat[i] for i in where],
                         *[weight.shard.read_value() for weight in self.weights])

    def _check_replayable(self, graph: Any, first_op: int) -> None:
        """Raises ConfigError if the unit's traced call holds a stateful op."""
        if graph in self.checked_graphs:
            return
        self.checked_graphs.add(graph)
        stateful = sorted({op.type for op in graph.get_operations()[first_op:]
                           if op.type in _STATEFUL_OPS})
        if stateful:
            raise ConfigError(f"zero_stage 3 recomputes each layer's call in the backward pass "
                              f"(zero.reshard_after_forward), which must replay the forward, "
                              f"but layer {self.name!r} draws random numbers or writes a "
                              f"variable in its call without a Keras seed or state variable; "
                              f"use keras.random with a keras.random.SeedGenerator, or set "
                              f"zero.reshard_after_forward false. Received: ops "
                              f"{', '.join(stateful)}")

    def __repr__(self) -> str:
        return f"<Unit {self.name}: {len(self.weights)} weights, {self.state.value}>"


def gather_bucket(weights: Sequence[Any], pieces: Sequence[tf.Tensor],
                  name: str) -> list[tf.Tensor]:
    """The whole values of `weights` (ShardedWeights) from every rank's `pieces` (this
    rank's slice of each, in one dtype), in one collective named `tfdist_zero3_<name>`.

    Each rank sends its slices side by side; the result holds rank 0's, then rank 1's:
    one row per rank, each weight a block of columns, copied out into its own tensor.
    """
    if len(weights) == 1:
        return [weights[0].whole_from(pieces[0], name)]
    ranks = weights[0].slicing.ranks
    widths = [weight.width for weight in weights]
    gathered = weights[0].collectives.gather(tf.concat(list(pieces), 0),
                                             name=f"tfdist_zero3_{name}")
    rows = tf.split(tf.reshape(gathered, [ranks, sum(widths)]), widths, axis=1)
    return [tf.reshape(tf.reshape(block, [-1])[:weight.size], weight.whole_shape)
            for weight, block in zip(weights, rows)]


def reduce_scatter_bucket(weights: Sequence[Any], grads: Sequence[tf.Tensor]) -> list[tf.Tensor]:
    """This rank's slice of each of `weights`' gradients `grads` (whole, dense or
    `tf.IndexedSlices`), averaged across ranks, in one collective named after the first.

    The reduce-scatter gives rank r its row: rank r's slice of every gradient, side by
    side, which is cut into them (views of the row, no copy).
    """
    if len(weights) == 1:
        return [weights[0].reduce_scatter_gradient(grads[0])]
    ranks = weights[0].slicing.ranks
    rows = [tf.reshape(tf.pad(tf.reshape(tf.convert_to_tensor(grad), [-1]),
                              [[0, weight.slicing.padded - weight.size]]), [ranks, weight.width])
            for weight, grad in zip(weights, grads)]
    mine = weights[0].collectives.reduce_scatter(
        tf.reshape(tf.concat(rows, 1), [-1]), name=f"tfdist_zero3_gradient_{weights[0].index}")
    return tf.split(mine, [weight.width for weight in weights])


def units_of(model: Any) -> list[Unit]:
    """The units of a model's layers, in the order their weights were created."""
    units: dict[int, Unit] = {}
    for variable in model.trainable_variables:
        unit = getattr(hooks.held(variable), "unit", None)
        if unit is not None:
            units.setdefault(id(unit), unit)
    return list(units.values())
