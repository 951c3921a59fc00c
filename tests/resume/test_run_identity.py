"""A checkpoint folder resumes only the run that made it; another run is refused in one line."""

import json

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tfdist.errors import ConfigError
from tfdist.resume.run_identity import RUN_FILE, differences

pytestmark = pytest.mark.slow


def train(folder, *, epochs=2, learning_rate=0.01, units=1, batch=8, capsys=None, **overrides):
    """A small fit with checkpoints in `folder`; returns the epochs it trained."""
    keras.backend.clear_session(free_memory=False)
    runner = tfdist.Runner(tfdist.load_config(overrides={"strategy": "one_device", **overrides}))
    data = runner.dataset(tf.data.Dataset.from_tensor_slices(
        (np.ones((32, 3), "float32"), np.zeros((32, units), "float32"))), batch)
    with runner.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(units)])
        model.compile(runner.optimizer(keras.optimizers.Adam(learning_rate)), "mse")
    history = model.fit(data, epochs=epochs, verbose=0,
                        callbacks=runner.callbacks(checkpoint_dir=folder))
    return history.epoch


def test_the_same_run_resumes_and_more_epochs_train_it_longer(tmp_path):
    assert train(tmp_path, epochs=2) == [0, 1]
    recorded = json.loads((tmp_path / RUN_FILE).read_text())
    assert recorded["epochs"] == 2 and recorded["optimizer"]["learning_rate"] == 0.01
    assert train(tmp_path, epochs=3) == [2]
    assert json.loads((tmp_path / RUN_FILE).read_text())["epochs"] == 3


@pytest.mark.parametrize("change, said", [
    ({"learning_rate": 0.1}, "optimizer.learning_rate: 0.01 -> 0.1"),
    ({"epochs": 1}, "epochs: 2 -> 1 (fewer)"),
    ({"batch": 16}, "steps_per_epoch: 4 -> 2"),
    ({"units": 2}, "the model's variables (2 -> 2, first change: sequential/dense/kernel "
                   "[3, 1] float32 -> sequential/dense/kernel [3, 2] float32)"),
    ({"accumulation_steps": 2}, "accumulation_steps: 1 -> 2"),
], ids=["learning_rate", "fewer_epochs", "batch", "model", "accumulation"])
def test_another_run_in_the_folder_is_refused_with_what_differs(change, said, tmp_path):
    train(tmp_path)
    with pytest.raises(ConfigError) as raised:
        train(tmp_path, **change)
    message = str(raised.value)
    assert message.startswith(f"checkpoint folder {tmp_path} holds another run: ")
    assert said in message
    assert message.endswith(f"Start fresh with another checkpoint folder (or delete this one), "
                            f"or resume it anyway with checkpoint.resume_changed=true. "
                            f"Received: checkpoint_dir={str(tmp_path)!r}")


def test_resume_changed_resumes_anyway_and_says_what_changed(tmp_path, capsys):
    train(tmp_path, epochs=2)
    trained = train(tmp_path, epochs=3, learning_rate=0.1,
                    **{"checkpoint.resume_changed": True})
    assert trained == [2]
    assert ("although the run changed (checkpoint.resume_changed): "
            "optimizer.learning_rate: 0.01 -> 0.1") in capsys.readouterr().err


def test_a_finished_run_started_again_says_so_in_one_line(tmp_path, capsys):
    train(tmp_path, epochs=2)
    capsys.readouterr()
    assert train(tmp_path, epochs=2) == []
    assert (f"the run in {tmp_path} finished all 2 epochs: nothing to train. Ask for more "
            f"epochs to train it longer, or use another checkpoint folder to start a new run"
            ) in capsys.readouterr().err


def test_a_folder_of_an_earlier_tfdist_without_a_record_resumes_and_gets_one(tmp_path):
    train(tmp_path, epochs=2)
    (tmp_path / RUN_FILE).unlink()
    assert train(tmp_path, epochs=3) == [2]
    assert (tmp_path / RUN_FILE).exists()


def test_differences_ignore_more_epochs_and_name_each_setting():
    before = {"epochs": 2, "optimizer": {"class": "Adam", "beta_1": 0.9}, "seed": 1}
    assert differences(before, {**before, "epochs": 5}) == []
    assert differences(None, before) == []
    assert differences(before, {**before, "optimizer": {"class": "SGD"}, "seed": 2}) == [
        "optimizer.beta_1: 0.9 -> null", "optimizer.class: Adam -> SGD", "seed: 1 -> 2"]


def test_a_model_built_on_its_first_batch_records_its_built_variables(tmp_path):
    # No Input layer: Keras builds the model in fit, before the callbacks start.
    def fit(epochs):
        keras.backend.clear_session(free_memory=False)
        runner = tfdist.Runner(tfdist.load_config(overrides={"strategy": "one_device"}))
        data = runner.dataset(tf.data.Dataset.from_tensor_slices(
            (np.ones((32, 3), "float32"), np.zeros((32,), "int32"))), 8)
        with runner.scope():
            model = keras.Sequential([keras.layers.Embedding(10, 4), keras.layers.Dense(1)])
            model.compile(runner.optimizer("sgd"), "mse")
        return model.fit(data, epochs=epochs, verbose=0,
                         callbacks=runner.callbacks(checkpoint_dir=tmp_path)).epoch

    assert fit(1) == [0]
    recorded = json.loads((tmp_path / RUN_FILE).read_text())["model"]
    assert recorded[0].startswith("sequential/embedding/embeddings [10, 4]") and len(recorded) == 3
    assert fit(2) == [1]
