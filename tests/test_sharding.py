"""Sharded training state in one process: the partition, the refusals, one_device.

The ranks' training is in `tests/adapters/test_zero.py` (real processes under mpirun).
"""

import glob
import os
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tfdist.sharding import (ELEMENT_WISE, ReduceScatteredWeight, ShardCollectives, ShardLayout,
                             ShardedWeight, Slicing, check_stage, state_bytes)
from tests import reference
from tests.conftest import REPO, last_json_line, run_command


def covered(layout, ranks):
    """Each variable's elements, counted over every rank's pieces."""
    counts = [np.zeros(size, int) for size in layout.sizes]
    for rank in range(ranks):
        for piece in layout.pieces(rank):
            counts[piece.variable][piece.start:piece.stop] += 1
    return counts


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_every_element_is_updated_by_exactly_one_rank(stage, ranks):
    layout = ShardLayout([320, 1024, 16, 48, 3], ranks, stage)
    assert all(np.all(count == 1) for count in covered(layout, ranks))


def test_stage_1_deals_whole_variables_largest_first_to_the_least_loaded():
    sizes = [320, 1024, 16, 48, 3]
    for ranks in (2, 3):
        layout = ShardLayout(sizes, ranks, 1)
        loads = [sum(p.stop for p in layout.pieces(rank)) for rank in range(ranks)]
        assert all(p.whole for rank in range(ranks) for p in layout.pieces(rank))
        assert max(loads) <= sum(sizes) / ranks + max(sizes)
    assert [p.variable for p in ShardLayout(sizes, 2, 1).pieces(0)] == [1]


@pytest.mark.parametrize("stage", [2, 3])
def test_stages_2_and_3_cut_each_variable_alone_into_equal_slices(stage):
    # Each gradient is reduce-scattered into these slices as the backward pass makes it.
    layout = ShardLayout([320, 1024, 16, 48, 3], 3, stage)
    assert layout.widths == [107, 342, 6, 16, 1]  # ceil(size / 3): the stored slices
    assert [(p.variable, p.start, p.stop) for p in layout.pieces(2)] == [
        (0, 214, 320), (1, 684, 1024), (2, 12, 16), (3, 32, 48), (4, 2, 3)]
    # Every rank a piece of every variable (empty where the variable is too small).
    assert [(p.start, p.stop) for p in ShardLayout([1], 3, stage).pieces(2)] == [(1, 1)]


def test_a_rank_can_own_nothing():
    assert ShardLayout([24, 3], 3, 1).pieces(2) == []          # two variables, three ranks


@pytest.mark.parametrize("size, ranks", [(10, 3), (320, 3), (1, 3), (48, 4), (7, 1)])
def test_a_slicing_covers_the_variable_once_in_equal_padded_slices(size, ranks):
    slicing = Slicing(size, ranks)
    bounds = [slicing.bounds(rank) for rank in range(ranks)]
    assert [start for start, _ in bounds] == [min(r * slicing.width, size) for r in range(ranks)]
    assert all(stop - start <= slicing.width for start, stop in bounds)
    assert np.array_equal(np.concatenate([np.arange(size)[start:stop] for start, stop in bounds]),
                          np.arange(size))
    assert slicing.padded == slicing.width * ranks >= size
    assert Slicing(10, 3).bounds(2) == (8, 10) and Slicing(1, 3).bounds(2) == (1, 1)


class _RankOf(ShardCollectives):
    """Which rank of how many: all that cutting a value into its slice needs (no
    collective is called)."""

    def __init__(self, rank, size):
        self.rank, self.size = rank, size


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_the_weights_cut_their_slices_where_the_layout_says(ranks):
    # The optimizer's layout, a stage-2 weight and a stage-3 weight's creation agree on every
    # rank's elements: one geometry, from `Slicing`.
    value = np.arange(10, dtype=np.float32).reshape(2, 5)
    layout = ShardLayout([10], ranks, stage=2)
    for rank in range(ranks):
        (piece,) = layout.pieces(rank)
        expected = np.pad(value.reshape(-1)[piece.start:piece.stop],
                          [0, layout.widths[0] - (piece.stop - piece.start)])
        stage_2 = ReduceScatteredWeight(tf.Variable(value), _RankOf(rank, ranks), index=0)
        assert stage_2.slicing == layout.slicings[0]
        assert np.array_equal(stage_2.slice_of(value).numpy(), expected)
        stage_3 = ShardedWeight(tf.Variable(expected), value.shape, _RankOf(rank, ranks), 0)
        assert (stage_3.width, stage_3.size) == (layout.widths[0], 10)


def test_the_storage_swap_is_undone_to_the_variable_keras_made():
    from tfdist.sharding import OneRankCollectives
    from tfdist.sharding.hooks import held
    from tfdist.sharding.weights import reduce_scattered

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    kernel = model.layers[0].kernel
    own = held(kernel)

    def kernel_gradient_shape():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(tf.ones([4, 3])))
        return tape.gradient(loss, model.trainable_variables)[0].shape

    undos = reduce_scattered(model.trainable_variables, OneRankCollectives())
    assert isinstance(held(kernel), ReduceScatteredWeight) and held(kernel).storage is own
    assert kernel_gradient_shape() == [6]  # this rank's slice, flattened: reduce-scattered
    for undo in undos:
        undo()
    assert held(kernel) is own
    assert kernel_gradient_shape() == [3, 2]


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("name", ["Lamb", "Adafactor", "Muon"])
def test_stages_2_and_3_refuse_optimizers_that_are_not_element_wise(name, stage):
    optimizer = getattr(keras.optimizers, name)(0.01)
    with pytest.raises(tfdist.ConfigError, match=f"zero_stage {stage} updates slices.*use "
                                                 f"zero_stage 1"):
        check_stage(stage, optimizer)
    check_stage(1, optimizer)  # Whole variables: any optimizer.


def test_stage_2_takes_the_element_wise_optimizers():
    for name in ELEMENT_WISE:
        check_stage(2, getattr(keras.optimizers, name)(0.01))


def test_a_subclass_that_may_change_the_update_is_refused_at_stage_2():
    class MyAdam(keras.optimizers.Adam):
        pass

    with pytest.raises(tfdist.ConfigError, match="MyAdam is not one of them"):
        check_stage(2, MyAdam(0.01))


def test_zero_stage_is_0_1_2_or_3():
    assert tfdist.load_config().zero_stage == 0
    assert tfdist.load_config(overrides={"zero_stage": 3}).zero_stage == 3
    with pytest.raises(tfdist.ConfigError, match="zero_stage must be 0, 1, 2 or 3"):
        tfdist.load_config(overrides={"zero_stage": 4})


@pytest.mark.parametrize("strategy", ["mirrored", "multi_worker", "parameter_server", "tpu"])
def test_strategies_that_cannot_shard_refuse_with_the_reason(strategy):
    with pytest.raises(tfdist.ConfigError) as error:
        tfdist.Runner(tfdist.load_config(overrides={"strategy": strategy, "zero_stage": 1}))
    message = str(error.value)
    assert message.startswith(f"zero_stage 1 cannot run under strategy {strategy}: ")
    assert "\n" not in message
    if strategy in ("mirrored", "multi_worker"):
        assert "strategy horovod" in message


def test_one_device_is_a_no_op():
    runs = {}
    for stage in (0, 2):
        keras.backend.clear_session()
        runner = tfdist.Runner(tfdist.load_config(overrides={
            "strategy": "one_device", "zero_stage": stage}))
        with runner.scope():
            model = reference.make_model(embedding=True)
            model.set_weights(reference.initial_weights(embedding=True))
            model.compile(runner.optimizer(keras.optimizers.Adam(0.01)),
                          "sparse_categorical_crossentropy")
        data = tf.data.Dataset.from_tensor_slices(reference.examples(96, embedding=True))
        model.fit(runner.dataset(data, 32), epochs=1, verbose=0)
        runs[stage] = (model.get_weights(), state_bytes(model.optimizer))
    assert runs[0][1] == runs[2][1]
    assert reference.largest_difference(runs[2][0], runs[0][0]) == 0.0


def test_elastic_training_is_refused():
    runner = tfdist.Runner(tfdist.load_config(overrides={"strategy": "one_device",
                                                         "zero_stage": 1}))
    with pytest.raises(tfdist.ConfigError, match="run_elastic cannot re-partition"):
        runner.run_elastic(lambda: None)


def test_weight_decay_exclusions_survive_the_runner():
    # runner.optimizer re-creates the optimizer from its config, which does not hold them.
    runner = tfdist.Runner(tfdist.load_config(overrides={"strategy": "one_device"}))
    optimizer = keras.optimizers.AdamW(0.01, weight_decay=0.5)
    optimizer.exclude_from_weight_decay(var_names=["bias"])
    made = runner.optimizer(optimizer)
    bias = keras.Variable(np.ones(3, "float32"), name="bias")
    kernel = keras.Variable(np.ones(3, "float32"), name="kernel")
    assert not made._use_weight_decay(bias) and made._use_weight_decay(kernel)


def test_shard_files_are_read_back_by_any_split_and_closed(tmp_path):
    from tfdist.resume import sharded_state

    values = np.arange(10, dtype="float32")
    # Two ranks wrote elements [0, 6) and [6, 10) of variable 0's "m" slot.
    for rank, (start, stop) in enumerate([(0, 6), (6, 10)]):
        sharded_state.write_shard(str(tmp_path), 4, rank, 2, [(0, "m", start, stop,
                                                               values[start:stop])])

    def open_shard_files():
        links = (os.readlink(fd) for fd in glob.glob("/proc/self/fd/*") if os.path.islink(fd))
        return sorted(link for link in links if link.startswith(str(tmp_path / "shards")))

    with sharded_state.ShardReader(str(tmp_path), 4) as reader:
        assert len(open_shard_files()) == 2
        # A third of the elements each, as 3 ranks would read them: across both files.
        parts = [reader.read(0, "m", start, stop) for start, stop in [(0, 4), (4, 7), (7, 10)]]
        with pytest.raises(tfdist.ConfigError, match="does not cover slot 'v' of variable 0"):
            reader.read(0, "v", 0, 10)
    np.testing.assert_array_equal(np.concatenate(parts), values)
    assert open_shard_files() == []
    with pytest.raises(tfdist.ConfigError, match="lacks the shard files of some ranks"):
        (tmp_path / "shards" / "ckpt-4.rank1-of-2.npz").unlink()
        sharded_state.ShardReader(str(tmp_path), 4)


# --- each stage's code in one process, on a one-rank communicator ------------------------

# Optimizers whose update sees every factor of the gradient (SGD with momentum), and one
# with clipping, weight decay and Adam's state; the AdamW clips each variable by its norm.
ONE_RANK_OPTIMIZERS = {
    "sgd_momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    "adamw_clipped": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1, clipnorm=0.05),
}


def train_on_one_rank(stage, optimizer_name, epochs=2):
    """`epochs` epochs of the reference model (an Embedding among its layers) on one rank;
    stage 0 is plain Keras."""
    from contextlib import nullcontext

    from tfdist.sharding import OneRankCollectives, sharded_creation, sharded_optimizer

    keras.backend.clear_session()
    collectives = OneRankCollectives()
    with sharded_creation(collectives) if stage == 3 else nullcontext():
        model = reference.make_model(embedding=True)
    model.set_weights(reference.initial_weights(embedding=True))
    optimizer = ONE_RANK_OPTIMIZERS[optimizer_name]()
    if stage:
        optimizer = sharded_optimizer(optimizer, collectives, stage)
    model.compile(optimizer, "sparse_categorical_crossentropy")
    optimizer.build(model.trainable_variables)  # as the horovod adapter does before a fit
    data = tf.data.Dataset.from_tensor_slices(reference.examples(96, embedding=True))
    model.fit(data.batch(32), epochs=epochs, verbose=0, shuffle=False)
    return model, optimizer


@pytest.fixture(scope="module")
def one_rank_runs():
    from tfdist import patches

    # The exact update of one device, as every adapter applies it: plain Keras clips a
    # sparse gradient (the Embedding's) by the norm of its rows before repeated rows are
    # summed, a different update from the same gradient made dense.
    applied = patches.apply(patches.EXACT_UPDATES)
    runs = {}

    def get(stage, optimizer_name):
        if (stage, optimizer_name) not in runs:
            model, optimizer = train_on_one_rank(stage, optimizer_name)
            saved = {}
            optimizer.save_own_variables(saved)  # what a `.keras` file holds
            runs[stage, optimizer_name] = (model.get_weights(), saved, optimizer)
        return runs[stage, optimizer_name]

    yield get
    patches.undo([patch for patch in patches.EXACT_UPDATES if patch.name in applied])


@pytest.mark.parametrize("optimizer_name", sorted(ONE_RANK_OPTIMIZERS))
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_each_stage_on_one_rank_equals_plain_keras(one_rank_runs, stage, optimizer_name):
    weights, saved, optimizer = one_rank_runs(stage, optimizer_name)
    plain_weights, plain_saved, _ = one_rank_runs(0, optimizer_name)
    users_class = type(ONE_RANK_OPTIMIZERS[optimizer_name]())
    assert isinstance(optimizer, users_class)
    assert optimizer.__class__.__name__ == users_class.__name__  # saved as the user's class
    assert optimizer.zero_stage == stage and int(optimizer.iterations.numpy()) == 6
    assert reference.largest_difference(weights, plain_weights) < 1e-6
    # The state it saves is plain Keras's, in plain Keras's order.
    assert sorted(saved) == sorted(plain_saved)
    assert reference.largest_difference([saved[k] for k in sorted(saved)],
                                        [plain_saved[k] for k in sorted(saved)]) < 1e-6


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_each_stage_reads_back_the_state_it_wrote_to_its_shard_file(one_rank_runs, stage):
    from tfdist.sharding import WEIGHT

    _, _, trained = one_rank_runs(stage, "adamw_clipped")
    parts = {(part.variable, part.slot): part.values for part in trained.shard_state()}
    assert (WEIGHT in {name for _, name in parts}) == (stage == 3)  # stage 3: its slices
    _, fresh = train_on_one_rank(stage, "adamw_clipped", epochs=1)  # another state
    before = {(part.variable, part.slot): part.values for part in fresh.shard_state()}
    assert sorted(before) == sorted(parts)
    assert all(not np.allclose(before[key], parts[key]) for key in parts)
    fresh.load_shard_state(lambda variable, name, start, stop:
                           parts[(variable, name)][start:stop], weights=stage == 3)
    again = {(part.variable, part.slot): part.values for part in fresh.shard_state()}
    assert sorted(again) == sorted(parts)
    assert all(np.array_equal(again[key], parts[key]) for key in parts)


def test_stage_2_takes_the_weights_from_a_stage_3_shard_file(one_rank_runs):
    # A stage-3 run resumed at stage 2: the weights are in the shard files, not whole in
    # the checkpoint, and stage 2 sets its whole variables from them.
    weights, _, trained = one_rank_runs(3, "adamw_clipped")
    parts = {(part.variable, part.slot): part.values for part in trained.shard_state()}
    model, fresh = train_on_one_rank(2, "adamw_clipped", epochs=1)
    assert reference.largest_difference(model.get_weights(), weights) > 1e-3
    fresh.load_shard_state(lambda variable, name, start, stop:
                           parts[(variable, name)][start:stop], weights=True)
    assert reference.largest_difference(model.get_weights(), weights) == 0.0


# --- the private members of Keras and TensorFlow that ZeRO relies on ---------------------


def test_every_private_member_zero_relies_on_is_in_the_installed_code():
    from tfdist.sharding import private

    assert private.missing() == []
    # Each declared member is one the sharding code uses: no stale declarations.
    source = "".join(path.read_text() for path in sorted(
        (REPO / "tfdist" / "sharding").glob("*.py")) if path.name != "private.py")
    assert [member.name for member in private.MEMBERS if member.name not in source] == []


def test_a_missing_private_member_is_one_line_naming_it():
    import dataclasses

    from tfdist.sharding import private

    value = private.MEMBERS[0]  # the Keras variable's `_value`, assigned in its source
    assert value.present() and not dataclasses.replace(value, how="attribute").present()
    gone = dataclasses.replace(value, name="_removed_by_a_newer_keras")
    for how in ("attribute", "assigned", "read"):  # each way of reading it can say absent
        assert not dataclasses.replace(gone, how=how).present()
    with pytest.raises(tfdist.ConfigError) as raised:
        private.check(3, [*private.MEMBERS, gone])
    message = str(raised.value)
    assert message.startswith("zero_stage 3 relies on private members") and "\n" not in message
    assert "Received: missing keras Variable._removed_by_a_newer_keras (" in message
    private.check(3)  # the installed code has every member


# Stage 3's creation as rank 0 of 4 (creation's only collective, the broadcast, is rank 0's
# own value here), counted by TensorFlow's allocator: a 64 MiB model.
CREATED_AS_ONE_OF_FOUR = """
import json
import keras, tensorflow as tf
from tfdist.memory import allocator_bytes
from tfdist.sharding import OneRankCollectives, sharded_creation

class FirstOfFour(OneRankCollectives):
    rank, size = 0, 4

before = allocator_bytes("CPU:0").current
with sharded_creation(FirstOfFour()):
    model = keras.Sequential([keras.Input((1024,))] +
                             [keras.layers.Dense(1024) for _ in range(16)])
slices = sum(v.value.shard.shape[0] for v in model.trainable_variables) * 4
print(json.dumps({"held": allocator_bytes("CPU:0").current - before, "slices": slices,
                  "whole": model.count_params() * 4}))
"""


@pytest.mark.multiprocess
def test_a_stage_3_rank_holds_its_slices_of_the_weights_not_the_whole_model(tmp_path):
    result = run_command([sys.executable, "-c", CREATED_AS_ONE_OF_FOUR], cwd=tmp_path,
                         env={"TF_CPU_ALLOCATOR_USE_BFC": "true"})
    assert result.returncode == 0, result.stderr[-3000:]
    figures = last_json_line(result.stdout)
    assert figures["slices"] * 4 >= figures["whole"] > 60 * 2**20
    # The slices, plus a few MiB of Keras's own (seeds, the layers' other state): a slice
    # that kept its whole value's buffer would hold all 64 MiB.
    assert figures["held"] < figures["slices"] + 8 * 2**20, figures
