"""Stage 3's units in one process, on a one-rank communicator: which layers are units,
that gathering again in the backward pass trains exactly as holding the gathered weights
and as plain Keras, on the model shapes users write, how often each weight is gathered,
that every read of a weight's slice stays ordered with its update in the step as
TensorFlow optimises it, and what a unit refuses.

The ranks' training with units (the default at stage 3) is in
`tests/adapters/test_zero.py` and `test_two_embeddings.py`; a model larger than one
rank's memory cap in `tests/test_memory.py`.
"""

import collections
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.protobuf import config_pb2
from tensorflow.python.grappler import tf_optimizer

from tests.conftest import REPO, run_command
from tfdist.errors import ConfigError
from tfdist.patches import keras_trainer
from tfdist.sharding import (OneRankCollectives, is_sharded, sharded_creation,
                             sharded_optimizer)
from tfdist.sharding.hooks import held
from tfdist.sharding.units import Gathering, Unit, buckets, units_of

BATCH, STEPS = 8, 4


class RecordedCollectives(OneRankCollectives):
    """The one-rank communicator, noting each collective's name in the graph it is traced in."""

    def __init__(self):
        super().__init__()
        self.issued = collections.defaultdict(list)  # graph -> names, in issue order
        self.dtypes = {}  # name -> the dtype it moves

    def gather(self, flat, name):
        self.issued[tf.compat.v1.get_default_graph()].append(name)
        self.dtypes[name] = flat.dtype.name
        return super().gather(flat, name)

    def reduce_scatter(self, flat, name):
        self.issued[tf.compat.v1.get_default_graph()].append(name)
        self.dtypes[name] = flat.dtype.name
        return super().reduce_scatter(flat, name)


class Scaled(keras.Model):
    """A subclassed model that owns a weight of its own besides its layers' (a unit whose
    call holds two other units)."""

    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(8, activation="tanh")
        self.out = keras.layers.Dense(1)

    def build(self, input_shape):
        self.scale = self.add_weight((8,), initializer="ones", name="scale")
        self.hidden.build(input_shape)
        self.out.build((None, 8))

    def call(self, inputs):
        return self.out(self.hidden(inputs) * self.scale)


class Block(keras.layers.Layer):
    """A user's residual block of two Dense layers, its weights all its inner layers'."""

    def __init__(self, width, rate=0.0, **kwargs):
        super().__init__(**kwargs)
        self.up = keras.layers.Dense(2 * width, activation="tanh")
        self.dropout = keras.layers.Dropout(rate) if rate else None
        self.down = keras.layers.Dense(width)

    def call(self, inputs, training=False):
        hidden = self.up(inputs)
        if self.dropout is not None:
            hidden = self.dropout(hidden, training=training)
        return inputs + self.down(hidden)


def make_model(kind):
    keras.utils.set_random_seed(3)
    if kind == "blocks":  # Two blocks of two Dense layers each, then a Dense.
        return keras.Sequential([keras.Input((8,)), Block(8, name="block_a"),
                                 Block(8, name="block_b"), keras.layers.Dense(1)])
    if kind == "blocks_dropout":
        return keras.Sequential([keras.Input((8,)), Block(8, rate=0.2, name="block_a"),
                                 keras.layers.Dense(1)])
    if kind == "sequential":  # Dropout and BatchNormalization between units.
        return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"),
                                 keras.layers.Dropout(0.3), keras.layers.BatchNormalization(),
                                 keras.layers.Dense(1)])
    if kind == "functional":  # Two inputs; one layer called twice in a step.
        first, second = keras.Input((8,)), keras.Input((4,))
        shared = keras.layers.Dense(3, activation="tanh")
        joined = keras.layers.Concatenate()([shared(keras.layers.Dense(6)(first)),
                                             shared(keras.layers.Dense(6)(second))])
        return keras.Model([first, second], keras.layers.Dense(1)(joined))
    if kind == "chain":  # Each unit's input is the output of the one before it.
        return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"),
                                 keras.layers.Dense(16, activation="tanh"),
                                 keras.layers.Dense(1)])
    if kind == "embedding":  # Integer inputs, a padding mask.
        tokens = keras.Input((5,), dtype="int32")
        embedded = keras.layers.Embedding(20, 8, mask_zero=True)(tokens)
        pooled = keras.layers.GlobalAveragePooling1D()(embedded)
        return keras.Model(tokens, keras.layers.Dense(1)(pooled))
    model = Scaled()
    model.build((None, 8))
    return model


def make_data(kind):
    rng = np.random.default_rng(1)
    count = BATCH * STEPS
    targets = rng.normal(size=(count, 1)).astype("float32")
    if kind == "functional":
        return [rng.normal(size=(count, 8)).astype("float32"),
                rng.normal(size=(count, 4)).astype("float32")], targets
    if kind == "embedding":
        return rng.integers(0, 20, size=(count, 5)).astype("int32"), targets
    return rng.normal(size=(count, 8)).astype("float32"), targets


OPTIMIZERS = {"sgd_momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
              "adam": lambda: keras.optimizers.Adam(0.01)}


def train(kind, optimizer, how, collectives=None, policy="float32", prefetch=0, bucket_bytes=0,
          unit=()):
    """(final weights, model, collectives) of 2 epochs: "plain" Keras, or stage 3 "held"
    (each gathered weight kept to the backward) or "regathered" (units, gathered `prefetch`
    calls ahead, in buckets of `bucket_bytes`, the layers named in `unit` each one unit)."""
    keras.backend.clear_session()
    keras.config.set_dtype_policy(policy)  # conftest restores the default after the test
    collectives = collectives or RecordedCollectives()
    if how == "plain":
        model, made = make_model(kind), OPTIMIZERS[optimizer]()
    else:
        gathering = Gathering(regather=how == "regathered", prefetch=prefetch,
                              bucket_bytes=bucket_bytes, unit=unit)
        with sharded_creation(collectives, gathering):
            model = make_model(kind)
        made = sharded_optimizer(OPTIMIZERS[optimizer](), collectives, 3)
    model.compile(made, "mse")
    if how != "plain":  # the sharded optimizer (inside a LossScaleOptimizer under float16)
        model.optimizer.build(model.trainable_variables)
    inputs, targets = make_data(kind)
    model.fit(inputs, targets, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    return [np.asarray(w) for w in model.get_weights()], model, collectives


def step_graph(collectives):
    """The traced train step: of the graphs that reduce-scatter gradients, the one in which
    the most collectives were issued (the end of fit gathers each weight and state in
    another)."""
    return max((graph for graph, names in collectives.issued.items()
                if any(name.startswith("tfdist_zero3_gradient_") for name in names)),
               key=lambda graph: len(collectives.issued[graph]))


def step_collectives(collectives):
    """How many times the train step issues each collective, by name."""
    return collections.Counter(collectives.issued[step_graph(collectives)])


def largest_difference(first, second):
    return max(float(np.max(np.abs(a - b))) for a, b in zip(first, second))


def test_each_layer_that_creates_weights_is_a_unit_of_its_own():
    with sharded_creation(OneRankCollectives()):
        model = make_model("sequential")
    units = units_of(model)
    assert [unit.name for unit in units] == ["dense", "batch_normalization", "dense_1"]
    assert [len(unit.weights) for unit in units] == [2, 2, 2]
    assert all(held(v).unit.name == v.path.split("/")[-2] for v in model.trainable_variables)
    with sharded_creation(OneRankCollectives(), Gathering(regather=False)):
        assert units_of(make_model("sequential")) == []


# Every model shape with SGD (whose update follows the gradient's scale); Adam where it
# differs from plain Keras (sparse rows) and on the model with state between its units.
@pytest.mark.parametrize("kind, optimizer", [
    ("sequential", "sgd_momentum"), ("sequential", "adam"), ("functional", "sgd_momentum"),
    ("embedding", "sgd_momentum"), ("embedding", "adam"), ("subclassed", "sgd_momentum")])
def test_gathering_again_trains_as_holding_the_gathered_weights_and_as_plain_keras(kind,
                                                                                   optimizer):
    regathered, model, _ = train(kind, optimizer, "regathered")
    assert units_of(model)
    held_weights, _, _ = train(kind, optimizer, "held")
    # A layer called twice sums its two gradients' slices in another order (1 ulp).
    assert largest_difference(regathered, held_weights) < 1e-6
    if kind == "embedding" and optimizer == "adam":
        # Plain Keras's Adam on a sparse gradient updates the rows it names alone, unless
        # tfdist's exact-update patch is applied in this process (by an earlier test, in
        # whatever order they run): only the stage-3 runs are compared.
        return
    plain, _, _ = train(kind, optimizer, "plain")
    assert largest_difference(regathered, plain) < 1e-6


def test_under_mixed_float16_the_recompute_computes_in_float16_as_the_forward():
    # The recompute runs outside Keras's __call__, which set the dtype the layer reads its
    # weights in: float32 weights there would change its result (or fail to multiply).
    regathered, _, _ = train("sequential", "adam", "regathered", policy="mixed_float16")
    held_weights, _, _ = train("sequential", "adam", "held", policy="mixed_float16")
    assert largest_difference(regathered, held_weights) == 0.0


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
@pytest.mark.parametrize("kind", ["functional", "subclassed"])
def test_under_a_mixed_policy_units_gather_in_the_compute_dtype_keras_reads_in(kind, policy):
    # SGD: its update follows each gradient element, where Adam's would hide a scale.
    regathered, model, collectives = train(kind, "sgd_momentum", "regathered", policy=policy)
    compute = policy.split("_")[1]
    step = set(step_collectives(collectives))  # the train step's collectives
    moved = collections.defaultdict(set)  # what each kind of collective moved in it
    for name in step:
        moved[name.rsplit("_", 1)[0]].add(collectives.dtypes[name])
    assert moved == {"tfdist_zero3_unit_forward": {compute},
                     "tfdist_zero3_unit_backward": {compute},
                     "tfdist_zero3_gradient": {"float32"}}
    # The master slices and the optimizer's state stay float32.
    assert {held(v).shard.dtype.name for v in model.trainable_variables} == {"float32"}
    assert {v.dtype for v in model.optimizer.variables if v.dtype != "int64"} == {"float32"}
    # Keras casts each whole float32 weight to the compute dtype as the layer reads it:
    # casting the slices before the gather gives the same values.
    plain, _, _ = train(kind, "sgd_momentum", "plain", policy=policy)
    if policy == "mixed_float16":
        assert largest_difference(regathered, plain) == 0.0
    else:
        # oneDNN (on by default on x86 CPUs) fuses plain Keras's cast of the float32 weight
        # into its bfloat16 matmul, which then rounds otherwise: exactly equal with oneDNN
        # off (the next test), within bfloat16's rounding with it on.
        assert largest_difference(regathered, plain) < 1e-2


# The bfloat16 comparison above with oneDNN off, which only a new process can set.
WITHOUT_ONEDNN = """
import sys
sys.path.insert(0, sys.argv[1])
from tests.test_units import largest_difference, train
for kind in ("functional", "subclassed"):
    regathered, _, collectives = train(kind, "sgd_momentum", "regathered", policy="mixed_bfloat16")
    assert {collectives.dtypes[name] for name in collectives.dtypes if "_unit_" in name} == {
        "bfloat16"}
    plain, _, _ = train(kind, "sgd_momentum", "plain", policy="mixed_bfloat16")
    print(kind, largest_difference(regathered, plain))
"""


def test_units_gathered_in_bfloat16_train_exactly_as_plain_keras_without_onednns_fusion(tmp_path):
    result = run_command([sys.executable, "-c", WITHOUT_ONEDNN, str(REPO)], cwd=tmp_path,
                         env={"TF_ENABLE_ONEDNN_OPTS": "0"}, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["functional", "0.0", "subclassed", "0.0"]


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_each_weight_is_gathered_twice_and_reduce_scattered_once_per_step(prefetch):
    _, model, collectives = train("sequential", "sgd_momentum", "regathered",
                                  prefetch=prefetch)
    step = collectives.issued[step_graph(collectives)]
    counts = collections.Counter(step)
    dense = [held(v).index for v in model.trainable_variables
             if "batch_normalization" not in v.path]
    norm = [held(v).index for v in model.trainable_variables if "batch_normalization" in v.path]
    for index in dense:  # units: the forward's gather and the backward's, then the gradient
        assert [counts[f"tfdist_zero3_unit_forward_{index}"],
                counts[f"tfdist_zero3_unit_backward_{index}"],
                counts[f"tfdist_zero3_gradient_{index}"],
                counts[f"tfdist_zero3_weight_{index}"]] == [1, 1, 1, 0], index
    for index in norm:  # state of its own: gathered once, held to the backward
        assert [counts[f"tfdist_zero3_unit_forward_{index}"],
                counts[f"tfdist_zero3_weight_{index}"],
                counts[f"tfdist_zero3_gradient_{index}"]] == [0, 1, 1], index
    assert len(step) == 3 * len(dense) + 2 * len(norm)


def matmuls_before(graph, name):
    """How many MatMul ops the collective `name` (in whatever name scope) waits for,
    through its inputs and control inputs."""
    [collective] = [op for op in graph.get_operations() if op.name.split("/")[-1] == name]
    seen, waiting = {}, [collective]
    while waiting:
        for before in [tensor.op for tensor in waiting[-1].inputs] + list(
                waiting.pop().control_inputs):
            if before.name not in seen:
                seen[before.name] = before
                waiting.append(before)
    return sum(op.type == "MatMul" for op in seen.values())


def test_prefetch_gathers_each_unit_while_the_units_before_and_after_it_compute():
    # Three Dense units in a chain: how many of the step's matmuls each gather waits for.
    waits, weights = {}, {}
    for prefetch in (0, 1, 2):
        weights[prefetch], model, collectives = train("chain", "sgd_momentum", "regathered",
                                                      prefetch=prefetch)
        graph = step_graph(collectives)
        kernels = [held(layer.kernel).index for layer in model.layers]
        waits[prefetch] = {direction: [matmuls_before(graph, f"tfdist_zero3_unit_{direction}_{k}")
                                       for k in kernels]
                           for direction in ("forward", "backward")}
    # Without prefetch unit k's forward gather waits for the k matmuls before it, and its
    # backward gather for the backward of the units after it.
    assert waits[0]["forward"] == [0, 1, 2]
    forward, backward = waits[0]["forward"], waits[0]["backward"]
    assert backward[0] > backward[1] > backward[2] > 0
    last = len(forward) - 1
    for prefetch in (1, 2):
        # Each gather waits for what the gather `prefetch` units earlier in its pass waits for.
        assert waits[prefetch]["forward"] == [forward[max(0, k - prefetch)]
                                              for k in range(last + 1)], prefetch
        assert waits[prefetch]["backward"] == [backward[min(last, k + prefetch)]
                                               for k in range(last + 1)], prefetch
        # Only when the collectives start changes: the same numbers.
        assert largest_difference(weights[prefetch], weights[0]) == 0.0


def test_a_layer_called_twice_in_a_step_gathers_for_each_call():
    _, model, collectives = train("functional", "sgd_momentum", "regathered")
    step = step_collectives(collectives)
    shared = next(layer for layer in model.layers if len(layer._inbound_nodes) == 2)
    for variable in shared.trainable_variables:
        index = held(variable).index
        assert [step[f"tfdist_zero3_unit_forward_{index}"],
                step[f"tfdist_zero3_unit_backward_{index}"],
                step[f"tfdist_zero3_gradient_{index}"]] == [2, 2, 2]


def test_predict_and_evaluate_gather_each_weight_once_with_no_gradient():
    _, model, collectives = train("sequential", "sgd_momentum", "regathered")
    collectives.issued.clear()
    inputs, targets = make_data("sequential")
    model.evaluate(inputs, targets, batch_size=BATCH, verbose=0)
    names = [name for issued in collectives.issued.values() for name in issued]
    assert names and all(name.startswith("tfdist_zero3_weight_") for name in names)


class Noisy(keras.layers.Layer):
    """Draws from TensorFlow's global random state in its call: a recompute would draw
    other numbers."""

    def build(self, input_shape):
        self.kernel = self.add_weight((input_shape[-1], 1))

    def call(self, inputs):
        return tf.matmul(inputs + tf.random.uniform(tf.shape(inputs)), self.kernel)


def test_a_unit_whose_call_draws_from_hidden_state_is_refused_in_one_line():
    with sharded_creation(OneRankCollectives()):
        model = keras.Sequential([keras.Input((8,)), Noisy(name="noisy")])
    optimizer = sharded_optimizer(keras.optimizers.SGD(0.1), OneRankCollectives(), 3)
    model.compile(optimizer, "mse")
    optimizer.build(model.trainable_variables)
    inputs, targets = make_data("sequential")
    with pytest.raises(ConfigError, match="layer 'noisy' draws random numbers or writes a "
                                          "variable in its call.*RandomUniform"):
        model.fit(inputs, targets, batch_size=BATCH, epochs=1, verbose=0)


def test_a_units_undo_gives_the_layer_its_own_call_back():
    with sharded_creation(OneRankCollectives()):
        layer = keras.layers.Dense(2)
        layer.build((None, 3))
    unit = held(layer.kernel).unit
    assert isinstance(unit, Unit) and "call" in vars(layer)
    unit.undo()
    assert "call" not in vars(layer) and held(layer.kernel).unit is None
    assert layer.call.__func__ is keras.layers.Dense.call


def built_in_fit(sharded):
    """(final weights, model) of 2 epochs of a model with no keras.Input under a one-device
    strategy, as the horovod adapter's: Keras builds it on its first batch inside fit."""
    keras.backend.clear_session()
    collectives = RecordedCollectives()
    with tf.distribute.OneDeviceStrategy("/cpu:0").scope():
        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.layers.Dense(16, activation="tanh"),
                                  keras.layers.Dense(1)])
        optimizer = OPTIMIZERS["sgd_momentum"]()
        model.compile(sharded_optimizer(optimizer, collectives, 3) if sharded else optimizer,
                      "mse")
    inputs, targets = make_data("sequential")
    model.fit(inputs, targets, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    return [np.asarray(w) for w in model.get_weights()], model


def test_a_model_built_on_its_first_batch_in_fit_is_made_of_slices_and_units():
    with keras_trainer.ZERO_BUILD_IN_CREATION_SCOPE.applied():
        weights, model = built_in_fit(sharded=True)
        plain, _ = built_in_fit(sharded=False)
    assert all(is_sharded(v) for v in model.trainable_variables)
    assert [unit.name for unit in units_of(model)] == ["dense", "dense_1"]
    assert largest_difference(weights, plain) < 1e-6


def test_a_creation_scope_inside_another_slices_each_weight_once():
    # A model built in fit called inside runner.scope(): the build's scope sits in the other.
    collectives = OneRankCollectives()
    with sharded_creation(collectives), sharded_creation(collectives):
        weight = keras.Variable(np.arange(6.0, dtype="float32"))
    assert isinstance(held(weight).shard, tf.Variable)  # not a slice of a slice
    np.testing.assert_array_equal(np.asarray(weight), np.arange(6.0))


def test_buckets_are_runs_of_consecutive_weights_within_the_bytes():
    assert buckets([400, 40, 400, 40], 500) == [[0, 1], [2, 3]]
    assert buckets([400, 40, 400, 40], 0) == [[0], [1], [2], [3]]
    assert buckets([900, 40, 40], 500) == [[0], [1, 2]]  # a larger weight goes alone
    assert buckets([10, 10, 10], 1 << 20) == [[0, 1, 2]]
    assert buckets([], 100) == []


@pytest.mark.parametrize("kind", ["sequential", "functional", "embedding", "subclassed"])
def test_a_bucket_gathers_each_units_weights_and_reduce_scatters_their_gradients_in_one(kind):
    unbucketed, alone_model, each = train(kind, "sgd_momentum", "regathered")
    bucketed, model, collectives = train(kind, "sgd_momentum", "regathered",
                                         bucket_bytes=1 << 20)
    # Each rank's slices side by side, cut back apart: the same numbers.
    assert largest_difference(bucketed, unbucketed) == 0.0
    step, alone = step_collectives(collectives), step_collectives(each)
    names = ("unit_forward", "unit_backward", "gradient")
    alone_units = {unit.name: unit for unit in units_of(alone_model)}
    for unit in filter(lambda unit: unit.recomputed, units_of(model)):
        first, *others = [weight.index for weight in unit.weights]
        # The unit's collectives, named after its first weight: as many as each of its
        # weights had alone (a nested unit gathers again in its outer unit's recompute).
        counts = [step[f"tfdist_zero3_{name}_{first}"] for name in names]
        assert min(counts) >= 1, unit
        for weight in alone_units[unit.name].weights:
            assert [alone[f"tfdist_zero3_{name}_{weight.index}"] for name in names] == counts
        for index in others:  # in the first weight's collectives, none of their own
            assert [step[f"tfdist_zero3_{name}_{index}"] for name in names] == [0, 0, 0], unit


def reads_and_updates(graph):
    """Each (read, update) pair of one variable in `graph` (a traced step) as TensorFlow
    runs it, after Grappler's default optimisation (what a function's execution applies),
    and whether one of the two waits for the other."""
    meta = tf.compat.v1.train.export_meta_graph(graph_def=graph.as_graph_def(), graph=graph)
    meta.collection_def["train_op"].node_list.value.extend(
        [op.name for op in graph.control_outputs] + [t.op.name for t in graph.outputs])
    nodes = {node.name: node for node in
             tf_optimizer.OptimizeGraph(config_pb2.ConfigProto(), meta).node}
    before = {}  # name -> every node it waits for, by data or control

    def waits_for(name):
        if name not in before:
            seen, stack = set(), [name]
            while stack:
                for source in nodes[stack.pop()].input:
                    source = source.lstrip("^").split(":")[0]
                    if source in nodes and source not in seen:
                        seen.add(source)
                        stack.append(source)
            before[name] = seen
        return before[name]

    users = collections.defaultdict(list)  # a variable's handle -> the nodes that take it
    for node in nodes.values():
        for source in node.input:
            taken = nodes.get(source.split(":")[0])
            if (not source.startswith("^") and taken is not None
                    and taken.attr["dtype"].type == tf.resource.as_datatype_enum):
                users[taken.name].append(node)
    return {(read.name, update.name): (read.name in waits_for(update.name)
                                       or update.name in waits_for(read.name))
            for handle in users.values()
            for read in handle if read.op == "ReadVariableOp"
            for update in handle if update.op != "ReadVariableOp"}


# The model shapes, and those that read a weight's slice again in the backward pass: a
# unit holding nested units (the subclassed model) reads theirs in its recompute, and no
# gradient of a nested layer's own weights depends on that read.
@pytest.mark.parametrize("kind, optimizer, options", [
    ("sequential", "sgd_momentum", {}), ("functional", "sgd_momentum", {}),
    ("embedding", "adam", {}), ("subclassed", "sgd_momentum", {}),
    ("subclassed", "adam", {}), ("subclassed", "sgd_momentum", {"bucket_bytes": 1 << 20}),
    ("subclassed", "sgd_momentum", {"prefetch": 1}),
    ("blocks", "sgd_momentum", {"unit": ("block_a",)})])
def test_every_read_of_a_weight_runs_before_its_update_as_tensorflow_optimises_the_step(
        kind, optimizer, options):
    _, model, collectives = train(kind, optimizer, "regathered", **options)
    # The weights whose update waits for every gradient: the nested units' alone.
    assert {v.path for v in model.trainable_variables if held(v).read_in_backward} == (
        {v.path for v in model.hidden.weights + model.out.weights}
        if kind == "subclassed" else set())
    pairs = reads_and_updates(step_graph(collectives))
    # Every trained slice is read and updated in the step.
    assert len({update for _, update in pairs}) >= len(model.trainable_variables)
    assert [pair for pair, ordered in pairs.items() if not ordered] == []


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_a_bucket_under_a_mixed_policy_gathers_in_the_compute_dtype(policy):
    unbucketed, _, _ = train("functional", "sgd_momentum", "regathered", policy=policy)
    bucketed, _, collectives = train("functional", "sgd_momentum", "regathered", policy=policy,
                                     bucket_bytes=1 << 20)
    assert largest_difference(bucketed, unbucketed) == 0.0
    moved = {collectives.dtypes[name] for name in step_collectives(collectives)}
    assert moved == {policy.split("_")[1], "float32"}  # gathers; the gradients' reduce-scatter


def test_a_bucket_holds_the_weights_that_fit_and_a_larger_one_goes_alone():
    # Dense(16)'s kernel is 8 * 16 * 4 = 512 bytes, its bias 64: a bucket of 100 bytes
    # takes the bias alone; the kernel goes in one of its own.
    _, model, collectives = train("chain", "sgd_momentum", "regathered", bucket_bytes=100)
    step = step_collectives(collectives)
    first = model.layers[0]
    assert step[f"tfdist_zero3_unit_forward_{held(first.kernel).index}"] == 1
    assert step[f"tfdist_zero3_unit_forward_{held(first.bias).index}"] == 1


def test_a_named_layer_is_one_unit_of_every_weight_inside_it():
    plain, _, _ = train("blocks", "adam", "plain")
    each, _, _ = train("blocks", "adam", "regathered")
    blocks, model, collectives = train("blocks", "adam", "regathered",
                                       unit=("block_a", "block_b"))
    units = units_of(model)
    assert [(unit.name, len(unit.weights)) for unit in units] == [
        ("block_a", 4), ("block_b", 4), ("dense_4", 2)]
    # The same ops, recomputed a block at a time (the residual's two gradients summed in
    # another order: float32's rounding, which Adam magnifies).
    assert largest_difference(blocks, each) < 1e-6
    assert largest_difference(blocks, plain) < 1e-6
    step = step_collectives(collectives)
    block = units[0]
    for weight in block.weights:  # gathered for the block's call and its backward, once each
        assert [step[f"tfdist_zero3_unit_forward_{weight.index}"],
                step[f"tfdist_zero3_unit_backward_{weight.index}"],
                step[f"tfdist_zero3_gradient_{weight.index}"]] == [1, 1, 1], weight
    # Both of the block's inner layers' weights are gathered before either computes.
    graph = step_graph(collectives)
    assert [matmuls_before(graph, f"tfdist_zero3_unit_forward_{weight.index}")
            for weight in block.weights] == [0, 0, 0, 0]


def test_a_named_layer_in_one_bucket_is_one_collective_each_way():
    _, model, collectives = train("blocks", "sgd_momentum", "regathered", bucket_bytes=1 << 20,
                                  unit=("block_a", "block_b"))
    step = step_collectives(collectives)
    assert len(step) == 3 * 3  # 3 units: each a gather, a gather again, a reduce-scatter
    assert all(count == 1 for count in step.values())


def test_zero_unit_naming_no_layer_or_one_with_state_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="zero.unit names layers that create no weights "
                                          "here: block_c;"):
        train("blocks", "sgd_momentum", "regathered", unit=("block_a", "block_c"))
    with pytest.raises(ConfigError, match="zero.unit names layer 'block_a', which updates "
                                          "state of its own in its call .*seed"):
        train("blocks_dropout", "sgd_momentum", "regathered", unit=("block_a",))
