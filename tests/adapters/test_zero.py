"""Sharded training state (zero_stage 1 and 2) under Keras 3 model.fit, with real ranks.

Every rank's weights equal one device's exact update on the same global batches
(1e-5), on 2 and on 3 ranks; each rank holds its share of the optimizer state; a
SIGKILL and a resume equal the uninterrupted run; a checkpoint of 2 ranks resumes on 3
and one of 3 on 2; `model.save` writes the whole state, which plain Keras loads.

Three launches make every run: each trains its variants in turn (`--variants`), since
starting TensorFlow and Horovod costs a launch more than one of these small runs does.
"""

import json
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
}
EQUIVALENT.update({
    # Micro-batches of half the global batch, 2 per update: one device at the whole batch.
    "s1_accumulate": (["--stage=1", "--optimizer=adam_clip", "--accumulation=2"], "adam_clip"),
    "s2_accumulate": (["--stage=2", "--optimizer=adam_clip", "--accumulation=2"], "adam_clip"),
})
ONLY_ON_2 = {
    "s2_clipnorm": (["--stage=2", "--optimizer=adam_clipnorm"], "adam_clipnorm"),
    "s2_ema": (["--stage=2", "--optimizer=adam_ema"], "adam_ema"),
    "s1_lamb": (["--stage=1", "--optimizer=lamb"], "lamb"),
    # A model with no keras.Input, built on its first batch in fit, each rank from its own
    # seed: the sharded optimizer builds on variables that did not exist at compile.
    "s2_deferred": (["--stage=2", "--optimizer=adam_clip", "--model=deferred"], "adam_clip",
                    "deferred"),
}
FP16_INF = (["--stage=2", "--optimizer=adam", "--model=dense", "--epochs=1",
             "--precision=mixed_float16", "--inf_at_step=3"],)
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
                         cwd=out, timeout=300)
    if expect_success:
        assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    return result


def killed_run(out):
    """A stage-2 run whose checkpoints are at steps 4, 6 and 8 (6 steps an epoch), and whose
    rank 1 is SIGKILLed after step 9, in epoch 2: (its arguments, the arguments that resume it)."""
    common = ["--stage=2", "--optimizer=adam_clip", f"--checkpoint_dir={out / 'killed'}",
              "--save_every_steps=4"]
    return common + ["--kill_at_step=9"], common


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    """The 2-rank runs: equivalence, a save, a checkpoint for 3 ranks, and, last, the run a
    SIGKILL ends (which ends the launch: every run before it has written its files)."""
    out = tmp_path_factory.mktemp("zero_2")
    killed = launch(out, {**EQUIVALENT, **ONLY_ON_2,
                          "s2_save": (["--stage=2", "--optimizer=adam_clip", "--save_model"],),
                          "fp16_inf": FP16_INF,
                          "to_3": (["--stage=2", "--optimizer=adam_clip", "--epochs=1",
                                    f"--checkpoint_dir={out / 'to_3_checkpoints'}"],),
                          "killed": (killed_run(out)[0],)}, 2, expect_success=False)
    assert killed.returncode != 0
    assert (out / "to_3" / "rank1.json").exists(), (killed.stdout + killed.stderr)[-3000:]
    assert not (out / "killed" / "rank0.json").exists()
    return out


@pytest.fixture(scope="module")
def three(two, tmp_path_factory):
    """The 3-rank runs, a resume of the 2-rank checkpoint, and a checkpoint for 2 ranks."""
    out = tmp_path_factory.mktemp("zero_3")
    launch(out, {**EQUIVALENT, **ONLY_ON_3, "fp16_inf": FP16_INF,
                 "from_2": (["--stage=2", "--optimizer=adam_clip",
                             f"--checkpoint_dir={two / 'to_3_checkpoints'}"],),
                 "to_2": (["--stage=1", "--optimizer=adam_clip", "--epochs=1",
                           f"--checkpoint_dir={out / 'to_2_checkpoints'}"],)}, 3)
    return out


@pytest.fixture(scope="module")
def resumed(two, three, tmp_path_factory):
    """The SIGKILLed run resumed; the 3-rank checkpoint resumed on 2 ranks."""
    out = tmp_path_factory.mktemp("zero_resumed")
    launch(out, {"resumed": (killed_run(two)[1],),
                 "from_3": (["--stage=2", "--optimizer=adam_clip",
                             f"--checkpoint_dir={three / 'to_2_checkpoints'}"],)}, 2)
    return out, two / "killed"


_references = {}


def one_device(optimizer, model="embedding", epochs=2):
    """Plain one-device training with the exact update, on the same global batches."""
    key = (optimizer, model, epochs)
    if key not in _references:
        import tensorflow as tf

        keras.backend.clear_session()
        runner = tfdist.Runner(tfdist.load_config(overrides={"strategy": "one_device",
                                                             "precision": "float32"}))
        with runner.scope():
            made = job.make_model(model)
            if model == "deferred":  # Built in fit, from rank 0's seed.
                keras.utils.set_random_seed(job.DEFERRED_SEED)
            else:
                made.set_weights(job.initial_weights(model))
            made.compile(runner.optimizer(job.optimizers()[optimizer]()),
                         "sparse_categorical_crossentropy")
        data = tf.data.Dataset.from_tensor_slices(job.examples(model, 6))
        made.fit(runner.dataset(data, job.GLOBAL_BATCH), epochs=epochs, verbose=0)
        _references[key] = (made.get_weights(),
                            [v.numpy() for v in made.optimizer.variables])
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
        for stage in (1, 2):
            reports, _ = ranks_of(out / f"s{stage}_adam_clip", ranks)
            largest = reports[0]["largest_variable_bytes"] * 2  # Adam: 2 slots
            bound = full / ranks * 1.01 if stage == 2 else full / ranks + largest
            held = [reports[r]["state_bytes"] for r in range(ranks)]
            assert max(held) <= bound, (stage, ranks, held, bound)
            # The step and the learning rate are on every rank; the slots once in all.
            assert sum(held) - (ranks - 1) * 12 == full, (stage, ranks, held, full)


@pytest.mark.parametrize("ranks", [2, 3])
def test_mixed_float16_inf_on_one_rank_skips_the_step_on_all(two, three, ranks):
    reports, weights = ranks_of((two if ranks == 2 else three) / "fp16_inf", ranks)
    # 6 steps, the inf in the last rank's slice of step 3: 5 updates, the scale halved once.
    assert [reports[r]["iterations"] for r in range(ranks)] == [5] * ranks
    assert [reports[r]["loss_scale"] for r in range(ranks)] == [2.0 ** 14] * ranks
    for rank in range(1, ranks):
        assert largest_difference(weights[0], weights[rank]) == 0.0
    assert all(np.all(np.isfinite(array)) for array in weights[0])


def test_a_sigkill_and_a_resume_equal_the_uninterrupted_run(two, resumed):
    out, checkpoints = resumed
    _, uninterrupted = ranks_of(two / "s2_adam_clip", 2)
    reports, weights = ranks_of(out / "resumed", 2)
    # It went on from the checkpoint of step 8, in epoch 2, not from the start.
    assert [reports[r]["iterations_at_start"] for r in (0, 1)] == [8, 8]
    assert [reports[r]["iterations"] for r in (0, 1)] == [12, 12]
    for rank in (0, 1):
        assert largest_difference(weights[rank], uninterrupted[rank]) < 1e-6
    # The shard files of the checkpoints kept, and of no others.
    shards = sorted(path.name for path in (checkpoints / "shards").iterdir())
    kept = sorted(path.name.split(".")[0] for path in checkpoints.glob("ckpt-*.index"))
    assert shards == [f"{number}.rank{r}-of-2.npz" for number in kept for r in (0, 1)]


def test_a_checkpoint_of_2_ranks_resumes_on_3_and_one_of_3_on_2(three, resumed):
    # Saved at the end of epoch 1 (6 steps) by one rank count, trained on by the other.
    reports = check_equivalent(three, "from_2", "adam_clip", 3)
    assert [reports[r]["iterations_at_start"] for r in range(3)] == [6] * 3
    out, _ = resumed
    reports = check_equivalent(out, "from_3", "adam_clip", 2)
    assert [reports[r]["iterations_at_start"] for r in (0, 1)] == [6] * 2


def test_model_save_writes_the_whole_state_and_plain_keras_loads_it(two, tmp_path):
    # A process with Keras alone: no tfdist, no Horovod.
    code = ("import sys, numpy as np, keras\n"
            "model = keras.models.load_model(sys.argv[1])\n"
            "print(type(model.optimizer).__module__, type(model.optimizer).__name__)\n"
            "np.savez(sys.argv[2], *[v.numpy() for v in model.optimizer.variables])\n")
    loaded = subprocess.run([sys.executable, "-c", code, str(two / "s2_save" / "model.keras"),
                             str(tmp_path / "loaded.npz")], capture_output=True, text=True,
                            timeout=120)
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    assert loaded.stdout.split()[-1] == "Adam"
    state = np.load(tmp_path / "loaded.npz")
    saved = [state[f"arr_{i}"] for i in range(len(state.files))]
    _, expected = one_device("adam_clip")  # the unsharded state, in plain Keras's order
    assert [a.shape for a in saved] == [a.shape for a in expected]
    assert largest_difference(saved, expected) < TOLERANCE
