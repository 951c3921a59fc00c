"""A checkpoint folder with one file missing, truncated or corrupt: the run resumes from
the newest checkpoint that reads, says which and why in one line, and never starts over
silently; with none readable it stops with one line (exit status 2 from the CLI)."""

import re
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tests.conftest import run_command
from tests.reference import examples, make_model
from tfdist.errors import ConfigError

pytestmark = pytest.mark.slow

STEPS = 4  # per epoch: 32 examples, batches of 8; checkpoints ckpt-4 and ckpt-8 after 2 epochs


def train(folder, epochs, **overrides):
    """The reference model trained with checkpoints in `folder`; (epochs trained, weights)."""
    keras.backend.clear_session(free_memory=False)
    runner = tfdist.Runner(tfdist.load_config(overrides={"strategy": "one_device", "seed": 3,
                                                         **overrides}))
    features, labels = examples(STEPS * 8)
    data = runner.dataset(tf.data.Dataset.from_tensor_slices((features, labels)), 8)
    with runner.scope():
        model = make_model()
        model.compile(runner.optimizer(keras.optimizers.SGD(0.1, momentum=0.9)),
                      "sparse_categorical_crossentropy")
    history = model.fit(data, epochs=epochs, verbose=0,
                        callbacks=runner.callbacks(checkpoint_dir=folder, keep=5))
    return history.epoch, model.get_weights()


def missing(path):
    path.unlink()


def truncated(path):
    path.write_bytes(path.read_bytes()[:len(path.read_bytes()) // 2])


def corrupt(path):
    """Same length, the middle third overwritten: what a bad disk block leaves."""
    data = bytearray(path.read_bytes())
    third = max(len(data) // 3, 1)
    data[third:2 * third] = bytes((b ^ 0x5A) for b in data[third:2 * third])
    path.write_bytes(bytes(data))


DAMAGES = {"missing": missing, "truncated": truncated, "corrupt": corrupt}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Three epochs without a break: what every resume must end at."""
    return train(tmp_path_factory.mktemp("uninterrupted"), 3)[1]


@pytest.mark.parametrize("damage", DAMAGES)
@pytest.mark.parametrize("file, resumed_at, said", [
    ("checkpoint", 8, r"resuming from \S+ckpt-8 \(the state file checkpoint (is missing|is "
                      r"unreadable|was unreadable \(set aside as checkpoint.unreadable\)): the "
                      r"checkpoints were found by their own files\): the end of epoch 2"),
    ("run.json", 8, r"resuming from \S+ckpt-8 \(run.json (is missing|cannot be read \(.+\)): "
                    r"the run's settings were not compared, and are recorded anew\): the end "
                    r"of epoch 2"),
    ("ckpt-8.index", 4, r"resuming from \S+ckpt-4 \(passed over, unreadable: ckpt-8 \(\w+: .+"
                        r"\)\): the end of epoch 1"),
    ("ckpt-8.data-00000-of-00001", 4, r"resuming from \S+ckpt-4 \(passed over, unreadable: "
                                      r"ckpt-8 \(\w+: .+\)\): the end of epoch 1"),
], ids=["state_file", "run_json", "index", "data"])
def test_one_damaged_file_resumes_from_the_newest_readable_checkpoint(
        file, resumed_at, said, damage, uninterrupted, tmp_path, capsys):
    assert train(tmp_path, 2)[0] == [0, 1]
    DAMAGES[damage](tmp_path / file)
    kept = {path.name: path.read_bytes() for path in tmp_path.glob("ckpt-4.*")}
    capsys.readouterr()
    epochs, weights = train(tmp_path, 3)
    said_lines = [line for line in capsys.readouterr().err.splitlines()
                  if line.startswith("tfdist: resuming")]
    expected = f"tfdist: {said} \\(step {resumed_at} in all\\)"
    assert len(said_lines) == 1 and re.fullmatch(expected, said_lines[0]), said_lines
    assert epochs == list(range(resumed_at // STEPS, 3))
    # Not started over: the same weights as three epochs without a break.
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(weights, uninterrupted)) < 1e-6
    # The readable older checkpoint is as it was.
    assert {path.name: path.read_bytes() for path in tmp_path.glob("ckpt-4.*")} == kept


def test_a_state_file_set_aside_by_an_earlier_start_does_not_explain_a_later_loss(tmp_path,
                                                                                  capsys):
    # The first resume sets the corrupt state file aside as checkpoint.unreadable; later the
    # new state file is deleted. The second resume must say it is missing, not that it was
    # unreadable: the file set aside is an earlier start's.
    train(tmp_path, 2)
    corrupt(tmp_path / "checkpoint")
    capsys.readouterr()
    train(tmp_path, 3)
    first = capsys.readouterr().err
    (tmp_path / "checkpoint").unlink()
    train(tmp_path, 4)
    second = capsys.readouterr().err
    assert "the state file checkpoint was unreadable (set aside as checkpoint.unreadable)" \
        in first
    assert "the state file checkpoint is missing" in second and "set aside" not in second


ZERO = {"strategy": "horovod", "zero_stage": 1}  # a rank's optimizer state in shards/


@pytest.fixture(scope="module")
def uninterrupted_zero(tmp_path_factory):
    return train(tmp_path_factory.mktemp("uninterrupted_zero"), 3, **ZERO)[1]


@pytest.mark.requires_horovod
@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_shard_of_sharded_optimizer_state_passes_its_checkpoint_over(
        damage, uninterrupted_zero, tmp_path, capsys):
    train(tmp_path, 2, **ZERO)
    DAMAGES[damage](tmp_path / "shards" / "ckpt-8.rank0-of-1.npz")
    capsys.readouterr()
    epochs, weights = train(tmp_path, 3, **ZERO)
    said = [line for line in capsys.readouterr().err.splitlines()
            if line.startswith("tfdist: resuming")]
    assert len(said) == 1 and re.fullmatch(
        r"tfdist: resuming from \S+ckpt-4 \(passed over, unreadable: ckpt-8 \(UnreadableShards: "
        r".+\)\): the end of epoch 1 \(step 4 in all\)", said[0]), said
    assert epochs == [1, 2]
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(weights, uninterrupted_zero)) < 1e-6


def test_every_checkpoint_unreadable_stops_with_one_line(tmp_path):
    train(tmp_path, 2)
    for number in (4, 8):
        truncated(tmp_path / f"ckpt-{number}.data-00000-of-00001")
    with pytest.raises(ConfigError, match=r"none of the 2 checkpoints in .* can be read \(newest: "
                                          r"ckpt-8 \(.+\)\); move them away to start over"):
        train(tmp_path, 3)
    assert sorted(path.name for path in tmp_path.glob("ckpt-*")) == [
        "ckpt-4.data-00000-of-00001", "ckpt-4.index", "ckpt-8.data-00000-of-00001",
        "ckpt-8.index"]


@pytest.mark.multiprocess
@pytest.mark.refuses
def test_the_cli_resumes_without_the_state_file_and_stops_with_exit_2_on_none(tmp_path):
    def cli(*args):
        return run_command([sys.executable, "-m", "tfdist.app.cli", "train",
                            "--strategy", "one_device", "--checkpoint_dir", "kk",
                            "--set", "train.dataset=synthetic", "--set",
                            "train.synthetic_examples=192", *args], cwd=tmp_path)

    assert cli("--set", "train.epochs=2").returncode == 0
    (tmp_path / "kk" / "checkpoint").unlink()
    resumed = cli("--set", "train.epochs=3")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert ("tfdist: resuming from kk/ckpt-6 (the state file checkpoint is missing: the "
            "checkpoints were found by their own files): the end of epoch 2 (step 6 in all)"
            in resumed.stderr), resumed.stderr[-2000:]
    for path in (tmp_path / "kk").glob("ckpt-*.index"):
        path.write_bytes(b"not an index")
    refused = cli("--set", "train.epochs=4")
    assert refused.returncode == 2
    last = refused.stderr.strip().splitlines()[-1]
    assert re.fullmatch(r"tfdist: error: none of the \d checkpoints in kk can be read "
                        r"\(newest: ckpt-9 \(.+\)\); move them away to start over\. "
                        r"Received: checkpoint_dir='kk'", last), refused.stderr[-2000:]
    assert "Traceback" not in refused.stderr
