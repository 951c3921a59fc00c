"""Sharded training state (zero_stage 1, 2 and 3) under Keras 3 model.fit, with real ranks.

Every rank's weights equal one device's exact update on the same global batches
(1e-5; in float64, 1e-15 with SGD and 1e-9 with Adam), on 2 and on 3 ranks; each rank
holds its share of the optimizer state (and at stage 3 of the weights); a SIGKILL and a
resume equal the uninterrupted run; a checkpoint of 2 ranks resumes on 3 and one of 3 on
2; `model.save` writes the whole state, which plain Keras loads.

Three launches make every run: each trains its variants in turn (`--variants`), since
starting TensorFlow and Horovod costs a launch more than one of these small runs does.
"""

import json
import shutil
import subprocess
import sys

import keras
import numpy as np
import pytest

import tfdist
from tests.conftest import REPO, mpirun, run_command

pytestmark = [pytest.mark.xdist_group("adapters_zero"), pytest.mark.requires_mpi,
              pytest.mark.requires_horovod, pytest.mark.multiprocess]

SCRIPT = str(REPO / "tests" / "scripts" / "zero_training.py")
TOLERANCE = 1e-5
MIXED_TOLERANCE = 1e-3  # float16 rounds by ~4e-5 here; a step more or less moves 1e-2+
BF16_TOLERANCE = 1e-2  # bfloat16 keeps 8 bits of mantissa: 4e-3 of a value near 1
# A hang bound, not a timing: a launch trains up to 37 small variants in turn (about 100 s
# alone on 2 cores, 475 s beside two other loads).
LAUNCH_BOUND_SECONDS = 900
sys.path.insert(0, str(REPO / "tests" / "scripts"))
import zero_training as job  # noqa: E402

# name: (arguments, what one device trains to compare with: optimizer[, model]).
EQUIVALENT = {
    "s1_adam_clip": (["--stage=1", "--optimizer=adam_clip"], "adam_clip"),
    "s2_adam_clip": (["--stage=2", "--optimizer=adam_clip"], "adam_clip"),
    "s1_adamw": (["--stage=1", "--optimizer=adamw"], "adamw"),
    "s2_adamw": (["--stage=2", "--optimizer=adamw"], "adamw"),
    "s1_sgd": (["--stage=1", "--optimizer=sgd_momentum"], "sgd_momentum"),
    "s2_sgd": (["--stage=2", "--optimizer=sgd_momentum"], "sgd_momentum"),
    # Stage 3: the weights themselves stored as slices, gathered where each layer reads them.
    "s3_adam_clip": (["--stage=3", "--optimizer=adam_clip"], "adam_clip"),
    "s3_adamw": (["--stage=3", "--optimizer=adamw"], "adamw"),
    "s3_sgd": (["--stage=3", "--optimizer=sgd_momentum"], "sgd_momentum"),
}
# Stage 3 with each gathered weight held to the backward pass (zero.reshard_after_forward
# false): the other runs gather each layer's weights again there.
HELD = {"s3_sgd_held": (["--stage=3", "--optimizer=sgd_momentum", "--held"], "sgd_momentum"),
        "s3_adam_clip_held": (["--stage=3", "--optimizer=adam_clip", "--held"], "adam_clip")}
EQUIVALENT.update({
    # Micro-batches of half the global batch, 2 per update: one device at the whole batch.
    "s1_accumulate": (["--stage=1", "--optimizer=adam_clip", "--accumulation=2"], "adam_clip"),
    "s2_accumulate": (["--stage=2", "--optimizer=adam_clip", "--accumulation=2"], "adam_clip"),
    "s3_accumulate": (["--stage=3", "--optimizer=adam_clip", "--accumulation=2"], "adam_clip"),
})
# Each family also trains SGD with momentum, unclipped: its update follows the gradient's
# scale, where Adam's barely moves when every gradient is multiplied by a constant and a
# clipped one not at all (a missing 1/N or 1/K would pass them).
SGD = "sgd_momentum"
EQUIVALENT.update({
    f"s{stage}_accumulate_sgd": ([f"--stage={stage}", f"--optimizer={SGD}", "--accumulation=2"],
                                 SGD) for stage in (1, 2, 3)})
# Users' model shapes, each trained at stage 3 with Adam and with SGD; "deferred" has no
# keras.Input: it is built on its first batch in fit, each rank from its own seed.
EQUIVALENT.update({
    f"s3_{model}{suffix}": (["--stage=3", f"--optimizer={optimizer}", f"--model={model}"],
                            optimizer, model)
    for model in ("two_inputs", "subclassed", "deferred")
    for suffix, optimizer in (("", "adam_clip"), ("_sgd", SGD))})
# Stage 3 gathering one and two layers ahead (zero.prefetch): the same numbers, with each
# gather started earlier; on the functional model a layer is called twice in a step.
EQUIVALENT.update({
    "s3_prefetch_sgd": (["--stage=3", f"--optimizer={SGD}", "--prefetch=1"], SGD),
    "s3_prefetch_2_adam_clip": (["--stage=3", "--optimizer=adam_clip", "--prefetch=2"],
                                "adam_clip"),
    "s3_two_inputs_prefetch_sgd": (["--stage=3", f"--optimizer={SGD}", "--model=two_inputs",
                                    "--prefetch=1"], SGD, "two_inputs")})
# Stage 3 with each layer's weights gathered in one collective and their gradients
# reduce-scattered in one (zero.bucket_mb): each rank's slices side by side, cut back apart.
EQUIVALENT.update({
    "s3_bucket_sgd": (["--stage=3", f"--optimizer={SGD}", "--bucket_mb=1"], SGD),
    "s3_bucket_prefetch_adam_clip": (["--stage=3", "--optimizer=adam_clip", "--bucket_mb=1",
                                      "--prefetch=1"], "adam_clip"),
    "s3_subclassed_bucket_sgd": (["--stage=3", f"--optimizer={SGD}", "--model=subclassed",
                                  "--bucket_mb=1"], SGD, "subclassed")})
# The subclassed model named as one unit of all its weights (zero.unit): gathered whole for
# its call and again for its backward pass, which recomputes it whole.
EQUIVALENT.update({
    "s3_subclassed_unit_sgd": (["--stage=3", f"--optimizer={SGD}", "--model=subclassed",
                                "--unit=classifier"], SGD, "subclassed"),
    "s3_subclassed_unit_bucket_adam_clip": (["--stage=3", "--optimizer=adam_clip",
                                             "--model=subclassed", "--unit=classifier",
                                             "--bucket_mb=1"], "adam_clip", "subclassed")})
# In float64, past float32's rounding (Adam magnifies it): stage 3 gathering again, one
# layer ahead in buckets, and accumulating; stage 2 beside it.
FLOAT64 = {"s3_f64_adam_clip": (["--stage=3", "--optimizer=adam_clip", "--float64"],
                                "adam_clip"),
           "s3_f64_prefetch_bucket_adam_clip": (["--stage=3", "--optimizer=adam_clip",
                                                 "--prefetch=1", "--bucket_mb=1", "--float64"],
                                                "adam_clip"),
           "s3_f64_accumulate_adam_clip": (["--stage=3", "--optimizer=adam_clip",
                                            "--accumulation=2", "--float64"], "adam_clip"),
           "s3_f64_sgd": (["--stage=3", f"--optimizer={SGD}", "--float64"], SGD),
           "s2_f64_adam_clip": (["--stage=2", "--optimizer=adam_clip", "--float64"],
                                "adam_clip")}
# SGD follows float64's rounding (measured 9e-17); Adam with clipping magnifies it (measured
# 6.0e-11, the same at both stages, on 2 and 3 ranks, and in every variant: float32 puts
# these runs 1e-7 apart).
FLOAT64_TOLERANCE = {SGD: 1e-15, "adam_clip": 1e-9}
# Dropout, BatchNormalization and a layer that drops inside its own call, at stage 3
# gathering again and holding: the same run, since the recompute must replay the forward.
RECOMPUTE = {f"s3_dropout_bn{suffix}": (["--stage=3", "--optimizer=adam_clip",
                                         "--model=dropout_bn", *held],)
             for suffix, held in (("", []), ("_held", ["--held"]))}
ONLY_ON_2 = {
    **HELD,
    "s2_clipnorm": (["--stage=2", "--optimizer=adam_clipnorm"], "adam_clipnorm"),
    "s2_ema": (["--stage=2", "--optimizer=adam_ema"], "adam_ema"),
    "s3_clipnorm": (["--stage=3", "--optimizer=adam_clipnorm"], "adam_clipnorm"),
    "s3_ema": (["--stage=3", "--optimizer=adam_ema"], "adam_ema"),
    "s1_lamb": (["--stage=1", "--optimizer=lamb"], "lamb"),
    # A model with no keras.Input, built on its first batch in fit, each rank from its own
    # seed: the sharded optimizer builds on variables that did not exist at compile.
    "s2_deferred": (["--stage=2", "--optimizer=adam_clip", "--model=deferred"], "adam_clip",
                    "deferred"),
}
FP16_INF = (["--stage=2", "--optimizer=adam", "--model=dense", "--epochs=1",
             "--precision=mixed_float16", "--inf_at_step=3"],)
FP16_INF_S3 = (["--stage=3", *FP16_INF[0][1:]],)
FP16_INF_SGD = (["--stage=2", f"--optimizer={SGD}", *FP16_INF[0][2:]],)
# Stage 3 under mixed_bfloat16: each unit gathers its weights in bfloat16 (as uint16 bits
# through Horovod's allgather, which takes no bfloat16: horovod/horovod#4047).
BF16_S3 = (["--stage=3", f"--optimizer={SGD}", "--model=dense", "--epochs=1",
            "--precision=mixed_bfloat16"],)
FP16_RUNS = {"fp16_inf": FP16_INF, "fp16_inf_s3": FP16_INF_S3, "fp16_inf_sgd": FP16_INF_SGD,
             "bf16_s3": BF16_S3}
ONLY_ON_3 = {
    # The Dense model has 2 variables: rank 2 owns none at stage 1.
    "s1_owns_nothing": (["--stage=1", "--optimizer=adam", "--model=dense"], "adam", "dense"),
}


def ranks_of(folder, count):
    """(reports by rank, weights by rank) of one run's folder."""
    reports = {r: json.loads((folder / f"rank{r}.json").read_text()) for r in range(count)}
    weights = {r: [array for _, array in sorted(np.load(folder / f"rank{r}.npz").items(),
                                                key=lambda item: int(item[0].split("_")[1]))]
               for r in range(count)}
    return reports, weights


def launch(out, variants, processes, expect_success=True):
    arguments = {name: args for name, (args, *_) in variants.items()}
    result = run_command(mpirun(sys.executable, SCRIPT, str(out), "--variants",
                                json.dumps(arguments), processes=processes),
                         cwd=out, timeout=LAUNCH_BOUND_SECONDS)
    if expect_success:
        assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    return result


# The optimizer of each SIGKILLed run: stage 2's Adam, stage 3's SGD.
KILLED_OPTIMIZER = {2: "adam_clip", 3: SGD}


def killed_run(out, stage=2):
    """A run whose checkpoints are at steps 4, 6 and 8 (6 steps an epoch), and whose rank 1
    is SIGKILLed after step 9, in epoch 2: (its arguments, the arguments that resume it)."""
    folder = out / ("killed" if stage == 2 else f"killed_s{stage}")
    common = [f"--stage={stage}", f"--optimizer={KILLED_OPTIMIZER[stage]}",
              f"--checkpoint_dir={folder}", "--save_every_steps=4"]
    return common + ["--kill_at_step=9"], common


def killed_accumulating_run(out):
    """A stage-3 run with SGD and accumulation 2 (12 micro-batches an epoch), whose
    checkpoints are at micro-batches 5, 10, 12 and 15 and whose rank 1 is SIGKILLed after
    micro-batch 16: its newest checkpoint is in the middle of an accumulation cycle, the
    half-summed gradient slices in each rank's shard file. (Its arguments, the arguments
    that resume it.)"""
    common = ["--stage=3", f"--optimizer={SGD}", "--accumulation=2",
              f"--checkpoint_dir={out / 'killed_s3_accumulate'}", "--save_every_steps=5"]
    return common + ["--kill_at_step=16"], common


def checkpointed(out, name, stage, optimizer="adam_clip"):
    """A run of epoch 1 (6 steps) that checkpoints at its end into out/<name>_checkpoints,
    for another rank count or stage to resume."""
    return ([f"--stage={stage}", f"--optimizer={optimizer}", "--epochs=1",
             f"--checkpoint_dir={out / (name + '_checkpoints')}"],)


def resuming(folder, stage, optimizer="adam_clip", *extra):
    """A run that resumes the checkpoints in `folder`, to the end of epoch 2."""
    return ([f"--stage={stage}", f"--optimizer={optimizer}", *extra,
             f"--checkpoint_dir={folder}"],)


# Rank-count changes and stage conversions, each with Adam and with SGD:
# name: (stage of the 2-rank run that checkpoints, stage of the run that resumes it).
CONVERSIONS = {"s2_2_to_3": (2, 2), "s3_2_to_3": (3, 3), "s2_to_s3": (2, 3), "s3_to_s2": (3, 2)}
OPTIMIZERS = {"": "adam_clip", "_sgd": SGD}


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    """The 2-rank runs: equivalence, a save, a checkpoint for 3 ranks, and, last, the run a
    SIGKILL ends (which ends the launch: every run before it has written its files)."""
    out = tmp_path_factory.mktemp("zero_2")
    saving = {f"{name}{suffix}": checkpointed(out, f"{name}{suffix}", stages[0], optimizer)
              for name, stages in CONVERSIONS.items() for suffix, optimizer in OPTIMIZERS.items()}
    saving.update({f"s2_accumulate_to_3{suffix}": (
        [*checkpointed(out, f"s2_accumulate_to_3{suffix}", 2, optimizer)[0], "--accumulation=2"],)
        for suffix, optimizer in OPTIMIZERS.items()})
    killed = launch(out, {**EQUIVALENT, **ONLY_ON_2, **FP16_RUNS, **RECOMPUTE, **FLOAT64, **saving,
                          "s2_save": (["--stage=2", "--optimizer=adam_clip", "--save_model"],),
                          "s3_save": (["--stage=3", "--optimizer=adam_clip", "--save_model"],),
                          "killed": (killed_run(out)[0],)}, 2, expect_success=False)
    assert killed.returncode != 0
    assert (out / "s2_2_to_3" / "rank1.json").exists(), (killed.stdout + killed.stderr)[-3000:]
    assert not (out / "killed" / "rank0.json").exists()
    return out


@pytest.fixture(scope="module")
def three(two, killed_s3_accumulate, tmp_path_factory):
    """The 3-rank runs, a resume of the 2-rank checkpoint, and a checkpoint for 2 ranks."""
    out = tmp_path_factory.mktemp("zero_3")
    # Each 2-rank checkpoint resumed on 3 ranks (a stage-3 one at stage 2 reads the weights
    # from the shard files), into a folder of the same name.
    resumes = {f"{name}{suffix}": resuming(two / f"{name}{suffix}_checkpoints", stages[1],
                                           optimizer)
               for name, stages in CONVERSIONS.items() for suffix, optimizer in OPTIMIZERS.items()}
    resumes.update({f"s2_accumulate_to_3{suffix}": resuming(
        two / f"s2_accumulate_to_3{suffix}_checkpoints", 2, optimizer, "--accumulation=2")
        for suffix, optimizer in OPTIMIZERS.items()})
    # The 2-rank stage-3 checkpoint taken in the middle of an accumulation cycle.
    resumes["s3_accumulate_from_2"] = resuming(killed_s3_accumulate / "for_3_ranks", 3, SGD,
                                               "--accumulation=2")
    launch(out, {**EQUIVALENT, **ONLY_ON_3, **FP16_RUNS, **FLOAT64, **resumes,
                 **{f"to_2{suffix}": checkpointed(out, f"to_2{suffix}", 1, optimizer)
                    for suffix, optimizer in OPTIMIZERS.items()}}, 3)
    return out


@pytest.fixture(scope="module")
def killed_s3(tmp_path_factory):
    """A stage-3 run on 2 ranks that a SIGKILL of rank 1 ends mid-epoch."""
    out = tmp_path_factory.mktemp("zero_killed_s3")
    killed = launch(out, {"killed_s3": (killed_run(out, stage=3)[0],)}, 2, expect_success=False)
    assert killed.returncode != 0
    assert not (out / "killed_s3" / "rank0.json").exists(), (killed.stdout + killed.stderr)[-3000:]
    return out


@pytest.fixture(scope="module")
def killed_s3_accumulate(tmp_path_factory):
    """`killed_accumulating_run`'s folder, and a copy of its checkpoints for 3 ranks to
    resume (each resume writes checkpoints of its own)."""
    out = tmp_path_factory.mktemp("zero_killed_s3_accumulate")
    arguments = killed_accumulating_run(out)[0]
    killed = launch(out, {"killed_s3_accumulate": (arguments,)}, 2, expect_success=False)
    assert killed.returncode != 0
    folder = out / "killed_s3_accumulate"
    assert not (folder / "rank0.json").exists(), (killed.stdout + killed.stderr)[-3000:]
    shutil.copytree(folder, out / "for_3_ranks")
    return out


@pytest.fixture(scope="module")
def resumed(two, three, killed_s3, killed_s3_accumulate, tmp_path_factory):
    """The SIGKILLed runs resumed; the 3-rank checkpoint resumed on 2 ranks."""
    out = tmp_path_factory.mktemp("zero_resumed")
    launch(out, {"resumed": (killed_run(two)[1],),
                 "resumed_s3": (killed_run(killed_s3, stage=3)[1],),
                 "resumed_s3_accumulate": (killed_accumulating_run(killed_s3_accumulate)[1],),
                 **{f"from_3{suffix}": resuming(three / f"to_2{suffix}_checkpoints", 2, optimizer)
                    for suffix, optimizer in OPTIMIZERS.items()}}, 2)
    return out, two / "killed"


_references = {}
_evaluated = {}  # One device's evaluate loss after training, by the same key.


def one_device(optimizer, model="embedding", epochs=2, precision="float32", inf_at_step=None,
               float64=False):
    """Plain one-device training with the exact update, on the same global batches (in
    float64 with `float64`)."""
    key = (optimizer, model, epochs, precision, inf_at_step, float64)
    if key not in _references:
        import tensorflow as tf

        keras.backend.clear_session()
        runner = tfdist.Runner(tfdist.load_config(overrides={"strategy": "one_device",
                                                             "precision": precision}))
        with runner.scope():
            if float64:  # the layers' policy, and floatx, which Keras's losses compute in
                keras.config.set_dtype_policy("float64")
                keras.config.set_floatx("float64")
            if model == "deferred":  # Built in fit, from rank 0's seed.
                keras.utils.set_random_seed(job.DEFERRED_SEED)
            made = job.make_model(model)
            if model != "deferred":
                made.set_weights(job.initial_weights(model))
            made.compile(runner.optimizer(job.optimizers()[optimizer]()),
                         "sparse_categorical_crossentropy")
        data = tf.data.Dataset.from_tensor_slices(job.examples(model, 6, inf_at_step))
        made.fit(runner.dataset(data, job.GLOBAL_BATCH), epochs=epochs, verbose=0)
        keras.config.set_floatx("float32")
        _references[key] = (made.get_weights(),
                            [v.numpy() for v in made.optimizer.variables])
        # As the ranks evaluate (a tf.data pipeline: `evaluate` on NumPy arrays, after fits
        # and clear_session in one process, crashed this process with SIGSEGV 3 times in
        # about 10 runs, inside Keras's EpochIterator.reset).
        _evaluated[key] = float(made.evaluate(runner.dataset(
            data, job.GLOBAL_BATCH, drop_remainder=False), verbose=0))
    return _references[key]


def largest_difference(first, second):
    return max(float(np.max(np.abs(a - b))) for a, b in zip(first, second))


def check_equivalent(out, name, optimizer, ranks, model="embedding"):
    reports, weights = ranks_of(out / name, ranks)
    expected, _ = one_device(optimizer, model)
    for rank in range(ranks):
        assert largest_difference(weights[rank], expected) < TOLERANCE, (name, rank)
    return reports


@pytest.mark.parametrize("name", sorted({**EQUIVALENT, **ONLY_ON_2}))
def test_two_ranks_equal_one_device(two, name):
    _, optimizer, *model = {**EQUIVALENT, **ONLY_ON_2}[name]
    reports = check_equivalent(two, name, optimizer, 2, *model)
    assert [reports[r]["iterations"] for r in (0, 1)] == [12, 12]


@pytest.mark.parametrize("name", sorted(FLOAT64))
def test_in_float64_two_and_three_ranks_equal_one_device_past_float32_rounding(two, three, name):
    _, optimizer = FLOAT64[name]
    expected, _ = one_device(optimizer, float64=True)
    assert expected[0].dtype == np.float64
    for out, ranks in ((two, 2), (three, 3)):
        _, weights = ranks_of(out / name, ranks)
        for rank in range(ranks):
            assert weights[rank][0].dtype == np.float64
            difference = largest_difference(weights[rank], expected)
            print(name, ranks, rank, difference)
            assert difference < FLOAT64_TOLERANCE[optimizer], (name, ranks, rank, difference)


@pytest.mark.parametrize("model", ["two_inputs", "subclassed", "deferred"])
def test_stage_3_gathers_each_layer_of_users_models_again(two, three, model):
    # Equal to one device above; and through each layer's unit, not a read held to the
    # backward pass (the model built in fit too: its weights made as slices there).
    expected = {"two_inputs": 4, "subclassed": 3, "deferred": 3}[model]  # layers with weights
    for out, ranks in ((two, 2), (three, 3)):
        reports, _ = ranks_of(out / f"s3_{model}", ranks)
        assert [len(reports[r]["units"]) for r in range(ranks)] == [expected] * ranks, reports


def test_a_layer_named_in_zero_unit_is_one_unit_of_every_weight_inside_it(two, three):
    # Equal to one device above; and the model is one unit of its 6 weights on every rank.
    for out, ranks in ((two, 2), (three, 3)):
        for name in ("s3_subclassed_unit_sgd", "s3_subclassed_unit_bucket_adam_clip"):
            reports, _ = ranks_of(out / name, ranks)
            assert [reports[r]["units"] for r in range(ranks)] == [["classifier"]] * ranks


def test_the_recompute_replays_dropout_and_batch_normalization(two):
    gathered_again, gathered_again_weights = ranks_of(two / "s3_dropout_bn", 2)
    held, held_weights = ranks_of(two / "s3_dropout_bn_held", 2)
    assert [len(held[r]["units"]) for r in (0, 1)] == [0, 0]
    # Every layer with weights is a unit; BatchNormalization's and the dropping layer's
    # calls, whose state a recompute would update again, read their weights as when held.
    assert gathered_again[0]["units"] == gathered_again[1]["units"]
    assert len(gathered_again[0]["units"]) == 5
    for rank in (0, 1):
        # The moving statistics are among the weights: updated once per step in both.
        assert largest_difference(gathered_again_weights[rank], held_weights[rank]) < 1e-6
    moving_mean, moving_variance = held_weights[0][5:7]
    assert np.max(np.abs(moving_mean)) > 1e-3 and np.max(np.abs(moving_variance - 1)) > 1e-3


def test_evaluate_after_a_stage_3_fit_equals_one_device_on_every_rank(two, three):
    one_device("adam_clip")
    expected = _evaluated[("adam_clip", "embedding", 2, "float32", None, False)]
    for out, ranks in ((two, 2), (three, 3)):
        reports, _ = ranks_of(out / "s3_adam_clip", ranks)
        losses = [reports[r]["evaluate_loss"] for r in range(ranks)]
        assert max(abs(loss - expected) for loss in losses) < TOLERANCE, (ranks, losses)


@pytest.mark.parametrize("name", sorted({**EQUIVALENT, **ONLY_ON_3}))
def test_three_ranks_equal_one_device(three, name):
    _, optimizer, *model = {**EQUIVALENT, **ONLY_ON_3}[name]
    reports = check_equivalent(three, name, optimizer, 3, *model)
    assert [reports[r]["iterations"] for r in range(3)] == [12] * 3
    if name == "s1_owns_nothing":
        assert reports[2]["partition"] == []


def test_the_clipping_and_decay_in_these_runs_change_the_result():
    # Otherwise the equivalence above would not show they are applied across shards.
    plain, _ = one_device("adam")
    for optimizer in ("adam_clip", "adam_clipnorm", "adamw"):
        assert largest_difference(one_device(optimizer)[0], plain) > 100 * TOLERANCE, optimizer


def test_each_rank_holds_its_share_of_the_state(two, three):
    full = sum(array.nbytes for array in one_device("adam_clip")[1])  # the unsharded state
    for out, ranks in ((two, 2), (three, 3)):
        reports, _ = ranks_of(out / "s1_adam_clip", ranks)
        largest = reports[0]["largest_variable_bytes"] * 2  # Adam: 2 slots
        held = [reports[r]["state_bytes"] for r in range(ranks)]
        assert max(held) <= full / ranks + largest, (ranks, held)
        # The step and the learning rate are on every rank; the slots once in all.
        assert sum(held) - (ranks - 1) * 12 == full, (ranks, held, full)


@pytest.mark.parametrize("stage", [2, 3])
def test_each_rank_holds_its_slice_of_each_variable_at_stages_2_and_3(two, three, stage):
    weights, _ = one_device("adam_clip")
    for out, ranks in ((two, 2), (three, 3)):
        reports, _ = ranks_of(out / f"s{stage}_adam_clip", ranks)
        slices = sum(-(-array.size // ranks) * 4 for array in weights)  # padded to N equal
        # Adam's two slots of each slice (padding included), the step and the rate.
        assert [reports[r]["state_bytes"] for r in range(ranks)] == [2 * slices + 12] * ranks
        # The backward pass gives each rank its slice of each gradient, nothing more.
        assert [reports[r]["gradient_bytes"] for r in range(ranks)] == [slices] * ranks
        whole = sum(array.size * 4 for array in weights)
        if stage == 2:
            assert [reports[r]["weight_bytes"] for r in range(ranks)] == [whole] * ranks
        else:  # The weights themselves are stored as those slices.
            assert [reports[r]["weight_bytes"] for r in range(ranks)] == [slices] * ranks
            assert reports[0]["largest_variable_bytes"] * ranks > slices


@pytest.mark.parametrize("folder, optimizer", [("fp16_inf", "adam"), ("fp16_inf_s3", "adam"),
                                               ("fp16_inf_sgd", SGD)])
@pytest.mark.parametrize("ranks", [2, 3])
def test_mixed_float16_inf_on_one_rank_skips_the_step_on_all_as_one_device(two, three, ranks,
                                                                           folder, optimizer):
    reports, weights = ranks_of((two if ranks == 2 else three) / folder, ranks)
    # 6 steps, the inf in the last rank's slice of step 3: 5 updates, the scale halved once.
    assert [reports[r]["iterations"] for r in range(ranks)] == [5] * ranks
    assert [reports[r]["loss_scale"] for r in range(ranks)] == [2.0 ** 14] * ranks
    for rank in range(1, ranks):
        assert largest_difference(weights[0], weights[rank]) == 0.0
    assert all(np.all(np.isfinite(array)) for array in weights[0])
    # One device with the inf in its global batch skips the same step (float16 sums of
    # other sizes round apart: hence the tolerance).
    expected, _ = one_device(optimizer, "dense", epochs=1, precision="mixed_float16",
                             inf_at_step=3)
    assert largest_difference(weights[0], expected) < MIXED_TOLERANCE


@pytest.mark.parametrize("ranks", [2, 3])
def test_stage_3_gathering_in_bfloat16_equals_one_device_in_bfloat16(two, three, ranks):
    reports, weights = ranks_of((two if ranks == 2 else three) / "bf16_s3", ranks)
    assert [reports[r]["iterations"] for r in range(ranks)] == [6] * ranks
    for rank in range(1, ranks):
        assert largest_difference(weights[0], weights[rank]) == 0.0
    # The gathered values are Keras's cast of the whole weights (exactly equal to plain
    # Keras with oneDNN off: tests/test_units.py); with oneDNN on, plain Keras's cast is
    # fused into its bfloat16 matmul, which rounds otherwise.
    expected, _ = one_device(SGD, "dense", epochs=1, precision="mixed_bfloat16")
    assert largest_difference(weights[0], expected) < BF16_TOLERANCE


@pytest.mark.parametrize("killed", ["s2", "s3", "s3_accumulate"])
def test_a_sigkill_and_a_resume_equal_the_uninterrupted_run(two, resumed, killed_s3,
                                                            killed_s3_accumulate, killed):
    out, checkpoints = resumed
    # The run SIGKILLed: (its checkpoints, the uninterrupted run, the resumed run, the
    # optimizer's updates before the resume). Without accumulation it went on from the
    # checkpoint of step 8, in epoch 2; with it, from micro-batch 15 (7 updates and half
    # a cycle), each rank's half-summed gradient slices read back from its shard file.
    checkpoints, uninterrupted, resumed_run, updates_before = {
        "s2": (checkpoints, "s2_adam_clip", "resumed", 8),
        "s3": (killed_s3 / "killed_s3", "s3_sgd", "resumed_s3", 8),
        "s3_accumulate": (killed_s3_accumulate / "killed_s3_accumulate", "s3_accumulate_sgd",
                          "resumed_s3_accumulate", 7)}[killed]
    _, uninterrupted = ranks_of(two / uninterrupted, 2)
    reports, weights = ranks_of(out / resumed_run, 2)
    assert [reports[r]["iterations_at_start"] for r in (0, 1)] == [updates_before] * 2
    assert [reports[r]["iterations"] for r in (0, 1)] == [12, 12]
    for rank in (0, 1):
        assert largest_difference(weights[rank], uninterrupted[rank]) < 1e-6
    # The shard files of the checkpoints kept, and of no others.
    shards = sorted(path.name for path in (checkpoints / "shards").iterdir())
    kept = sorted(path.name.split(".")[0] for path in checkpoints.glob("ckpt-*.index"))
    assert shards == [f"{number}.rank{r}-of-2.npz" for number in kept for r in (0, 1)]


@pytest.mark.parametrize("suffix", sorted(OPTIMIZERS))
@pytest.mark.parametrize("name", sorted(CONVERSIONS))
def test_a_checkpoint_of_2_ranks_resumes_on_3_at_either_stage(three, name, suffix):
    # Saved at the end of epoch 1 (6 steps) by 2 ranks at one stage (2 or 3), trained on by
    # 3 at the same or the other.
    reports = check_equivalent(three, f"{name}{suffix}", OPTIMIZERS[suffix], 3)
    assert [reports[r]["iterations_at_start"] for r in range(3)] == [6] * 3


@pytest.mark.parametrize("suffix", sorted(OPTIMIZERS))
def test_stage_2_with_accumulation_checkpoints_and_resumes_on_3_ranks(two, three, suffix):
    # With accumulation, stage 2 reduce-scatters once per cycle: its accumulators stay
    # whole (rank-local sums a checkpoint holds); without, the backward pass slices.
    reports, _ = ranks_of(two / "s2_accumulate", 2)
    _, plain = ranks_of(two / "s2_adam_clip", 2)
    whole = sum(array.size * 4 for array in plain[0])
    assert [reports[r]["gradient_bytes"] for r in (0, 1)] == [whole] * 2
    reports = check_equivalent(three, f"s2_accumulate_to_3{suffix}", OPTIMIZERS[suffix], 3)
    assert [reports[r]["iterations_at_start"] for r in range(3)] == [6] * 3


def test_a_stage_3_checkpoint_within_an_accumulation_cycle_resumes_on_3_ranks(
        three, killed_s3_accumulate):
    # Checkpoint 15 of 2 ranks: each rank's shard file holds its slice of the gradient
    # summed over micro-batch 15 alone (half a cycle); the chief's checkpoint none of it.
    files = [np.load(killed_s3_accumulate / "for_3_ranks" / "shards" / f"ckpt-15.rank{r}-of-2.npz")
             for r in (0, 1)]
    summed = [[files[r][f"a{i}"] for i, (_, slot, _, _) in
               enumerate(json.loads(str(files[r]["index"]))) if slot == tfdist.sharding.ACCUMULATED]
              for r in (0, 1)]
    assert [len(slices) for slices in summed] == [5, 5]  # one per weight, on each rank
    assert max(float(np.max(np.abs(array))) for array in summed[0] + summed[1]) > 1e-3
    import tensorflow as tf

    saved = [name for name, _ in tf.train.list_variables(
        str(killed_s3_accumulate / "for_3_ranks" / "ckpt-15"))]
    assert not [name for name in saved if "accumulated" in name], saved
    reports = check_equivalent(three, "s3_accumulate_from_2", SGD, 3)
    assert [reports[r]["iterations_at_start"] for r in range(3)] == [7] * 3


@pytest.mark.parametrize("suffix", sorted(OPTIMIZERS))
def test_a_checkpoint_of_3_ranks_resumes_on_2(resumed, suffix):
    out, _ = resumed
    reports = check_equivalent(out, f"from_3{suffix}", OPTIMIZERS[suffix], 2)
    assert [reports[r]["iterations_at_start"] for r in (0, 1)] == [6] * 2


@pytest.mark.parametrize("stage", [2, 3])
def test_model_save_writes_the_whole_state_and_plain_keras_loads_it(two, tmp_path, stage):
    # A process with Keras alone: no tfdist, no Horovod.
    code = ("import sys, numpy as np, keras\n"
            "model = keras.models.load_model(sys.argv[1])\n"
            "print(type(model.optimizer).__module__, type(model.optimizer).__name__)\n"
            "np.savez(sys.argv[2], *[v.numpy() for v in model.optimizer.variables])\n"
            "np.savez(sys.argv[3], *model.get_weights())\n")
    saved_model = str(two / f"s{stage}_save" / "model.keras")
    loaded = subprocess.run([sys.executable, "-c", code, saved_model, str(tmp_path / "loaded.npz"),
                             str(tmp_path / "weights.npz")], capture_output=True, text=True,
                            timeout=120)
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    assert loaded.stdout.split()[-1] == "Adam"
    state = np.load(tmp_path / "loaded.npz")
    saved = [state[f"arr_{i}"] for i in range(len(state.files))]
    weights, expected = one_device("adam_clip")  # the unsharded state, in plain Keras's order
    assert [a.shape for a in saved] == [a.shape for a in expected]
    assert largest_difference(saved, expected) < TOLERANCE
    loaded_weights = np.load(tmp_path / "weights.npz")
    loaded_weights = [loaded_weights[f"arr_{i}"] for i in range(len(loaded_weights.files))]
    assert [a.shape for a in loaded_weights] == [a.shape for a in weights]
    assert largest_difference(loaded_weights, weights) < TOLERANCE


REFUSALS = {
    # Accumulators in the middle of a cycle, as slices, that stage 2's whole ones cannot take.
    "sliced_accumulators_at_stage_2": (["--stage=2", f"--optimizer={SGD}", "--accumulation=2",
                                        "--checkpoint_dir={tmp}/sliced_accumulated"],
                                       "holds gradient accumulators as slices (saved at "
                                       "zero_stage 3 with accumulation_steps > 1), which this "
                                       "run would leave unrestored; resume it at zero_stage 3"),
    # Stage 2's whole accumulators, in the chief's checkpoint, that stage 3 cannot take.
    "whole_accumulators_at_stage_3": (["--accumulation=2",
                                       "--checkpoint_dir={tmp}/whole_accumulated"],
                                      "was saved at zero_stage 1 or 2, whose gradient "
                                      "accumulators are whole, where zero_stage 3 with "
                                      "accumulation_steps > 1 holds them as slices"),
    "sliced_weights_at_stage_1": (["--stage=1", "--checkpoint_dir={tmp}/sliced"],
                                  "checkpoint "),  # then its number, and:
    "sharded_state_at_stage_0": (["--stage=0", "--checkpoint_dir={tmp}/sharded"],
                                 "in {tmp}/sharded holds sharded optimizer state (saved with "
                                 "zero_stage 1 or 2)"),
    "whole_state_at_stage_2": (["--stage=2", "--checkpoint_dir={tmp}/whole"],
                               "in {tmp}/whole has no sharded optimizer state (it was saved "
                               "with zero_stage 0)"),
}
SLICED = ("holds each weight as slices (saved with zero_stage 3); resume it with zero_stage 2 "
          "or 3")


# One rank at stage 3, in a fresh process: what a user may try on a model whose weights are
# slices, each answered in one line. Each attempt's error (or null) is a JSON line.
STAGE_3_ATTEMPTS = """
import json
import numpy as np, keras, tensorflow as tf
import tfdist

runner = tfdist.Runner(tfdist.load_config(overrides={"strategy": "horovod", "zero_stage": 3}))
with runner.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="out")])
    model.compile(runner.optimizer(keras.optimizers.Adam(0.01)), "mse")
data = runner.dataset(tf.data.Dataset.from_tensor_slices(
    (np.zeros((8, 4), "float32"), np.zeros((8, 3), "float32"))), 8)


def layer_made_before_the_scope():
    made_before = keras.layers.Dense(3)
    made_before.build((None, 4))
    with runner.scope():
        other = keras.Sequential([keras.Input((4,)), made_before])
        other.compile(runner.optimizer(keras.optimizers.SGD(0.1)), "mse")
    other.fit(data, epochs=1, verbose=0, callbacks=runner.callbacks())


def fit_then_load_another_optimizers_state():
    model.fit(data, epochs=1, verbose=0, callbacks=runner.callbacks())
    model.optimizer.load_own_variables({"0": np.zeros(1)})


for name, attempt in {
        "save_before_fit": lambda: model.save("model.keras"),
        "load_state_before_fit": lambda: model.optimizer.load_own_variables({"0": np.zeros(1)}),
        "export_before_fit": lambda: model.export("exported"),
        "tf_saved_model_save": lambda: tf.saved_model.save(model, "saved_model"),
        "layer_made_before_the_scope": layer_made_before_the_scope,
        "load_another_optimizers_state": fit_then_load_another_optimizers_state}.items():
    try:
        attempt()
        print(json.dumps({name: None}))
    except tfdist.ConfigError as error:
        print(json.dumps({name: str(error)}))
# Horovod's cycle, shortened for stage 3's collectives, which go one after another.
import os
print(json.dumps({"cycle_time_ms": os.environ.get("HOROVOD_CYCLE_TIME")}))
"""


@pytest.mark.multiprocess
@pytest.mark.refuses
def test_what_stage_3_weights_cannot_do_is_one_line(tmp_path):
    result = run_command([sys.executable, "-c", STAGE_3_ATTEMPTS], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    said = {}
    for line in result.stdout.splitlines():
        if line.startswith("{"):
            said.update(json.loads(line))
    assert all(message and "\n" not in message for message in said.values()), said
    assert said["save_before_fit"].startswith(
        "a zero_stage 3 optimizer holds 1/N of its state on each rank, gathered to rank 0 at "
        "the end of each fit: save the model on rank 0 after fit returns")
    assert said["load_state_before_fit"].startswith(
        "this Adam is not built yet, so it has no place for saved state, which would be lost")
    assert said["export_before_fit"].startswith(
        "model.export at zero_stage 3 exports the whole weights kept at the end of fit")
    assert said["tf_saved_model_save"].startswith(
        "a SavedModel of a zero_stage 3 model needs its whole weights")
    assert said["layer_made_before_the_scope"].startswith(
        "zero_stage 3 stores each trainable variable as 1/N per rank from its creation, under "
        "runner.scope(), but 2 variable(s) were created outside it (a layer made before the "
        "scope)")
    assert said["cycle_time_ms"] == "0.1"
    assert said["load_another_optimizers_state"].startswith(
        "the saved optimizer state has 1 variables, where this Adam built on these weights "
        "has 6")


@pytest.mark.parametrize("case", sorted(REFUSALS))
@pytest.mark.refuses
def test_stage_3_refuses_what_it_cannot_do_yet_with_one_line(two, killed_s3_accumulate,
                                                             tmp_path, case):
    # One rank (no mpirun): each refusal comes before any step. The checkpoints are the
    # 2-rank runs' at stage 3 (sliced) and 2 (sharded), each also with accumulation, and
    # one rank's at stage 0 (whole).
    shutil.copytree(two / "s3_2_to_3_checkpoints", tmp_path / "sliced")
    shutil.copytree(two / "s2_2_to_3_checkpoints", tmp_path / "sharded")
    shutil.copytree(killed_s3_accumulate / "for_3_ranks", tmp_path / "sliced_accumulated")
    shutil.copytree(two / "s2_accumulate_to_3_checkpoints", tmp_path / "whole_accumulated")
    if case == "whole_state_at_stage_2":
        made = run_command([sys.executable, SCRIPT, str(tmp_path / "whole_run"), "--stage=0",
                            "--epochs=1", f"--checkpoint_dir={tmp_path}/whole"], cwd=tmp_path)
        assert made.returncode == 0, made.stderr[-2000:]
    arguments, expected = REFUSALS[case]
    result = run_command([sys.executable, SCRIPT, str(tmp_path / "out"), "--stage=3",
                          *[argument.format(tmp=tmp_path) for argument in arguments]],
                         cwd=tmp_path)
    assert result.returncode != 0
    # The error's line; TensorFlow may warn after it, at exit, about what it left unrestored.
    errors = [line for line in result.stderr.splitlines() if line.startswith("tfdist.errors.")]
    assert errors, result.stderr[-3000:]
    assert errors[-1].startswith("tfdist.errors.ConfigError: "), errors[-1]
    assert expected.format(tmp=tmp_path) in errors[-1], errors[-1]
    if case == "sliced_weights_at_stage_1":
        assert SLICED in errors[-1], errors[-1]
