"""CheckpointStore and TrainingPosition: atomic saves, the newest kept, torn ones passed over."""

import logging as python_logging

import numpy as np
import pytest
import tensorflow as tf

from tfdist import ConfigError
from tfdist.resume.checkpointing import CheckpointStore, TrainingPosition, checkpoint_number


def store_of(directory, value=0.0, *, is_writer=True, keep=3, shape=(3,)):
    variable = tf.Variable(tf.fill(shape, value))
    position = TrainingPosition()
    store = CheckpointStore(directory, {"weights": [variable], "position": position},
                            is_writer=is_writer, keep=keep)
    return store, variable, position


def save_steps(store, variable, position, steps):
    for step in steps:
        variable.assign(tf.fill(variable.shape, float(step)))
        position.move_to(0, step, step)
        position.record()
        store.save(step)


def test_restores_the_newest_and_keeps_the_last_k(tmp_path):
    store, variable, position = store_of(tmp_path, keep=2)
    save_steps(store, variable, position, [4, 8, 12])
    assert [checkpoint_number(path) for path in store.candidates()] == [12, 8]
    assert not list(tmp_path.glob("ckpt-4.*"))
    fresh, restored, where = store_of(tmp_path)
    assert checkpoint_number(fresh.restore_newest()) == 12
    where.reload()
    assert restored.numpy().tolist() == [12.0] * 3 and where.global_step == 12


def test_the_kept_checkpoints_are_known_without_reading_the_folder(tmp_path):
    # What a save leaves in the folder (the store's own list, and what it found at its start
    # by the checkpoints' files when the state file was lost), each time as candidates()
    # reads it from the folder.
    def in_the_folder(store):
        return {checkpoint_number(path) for path in store.candidates()}

    store, variable, position = store_of(tmp_path, keep=2)
    for step in (4, 8, 12):
        save_steps(store, variable, position, [step])
        assert store.kept_numbers() == in_the_folder(store)
    (tmp_path / "checkpoint").unlink()
    store, variable, position = store_of(tmp_path, keep=2)
    for step in (16, 20, 24):
        save_steps(store, variable, position, [step])
        assert store.kept_numbers() == in_the_folder(store) == {8, 12, step - 4, step}


def test_an_empty_folder_restores_nothing(tmp_path):
    store, variable, _ = store_of(tmp_path, 7.0)
    assert store.restore_newest() is None
    assert variable.numpy().tolist() == [7.0] * 3


@pytest.mark.parametrize("tear", ["truncated data", "garbage index", "missing data"])
def test_a_torn_newest_checkpoint_falls_back_to_the_one_before(tear, tmp_path, caplog):
    store, variable, position = store_of(tmp_path)
    save_steps(store, variable, position, [4, 8])
    data, index = tmp_path / "ckpt-8.data-00000-of-00001", tmp_path / "ckpt-8.index"
    if tear == "truncated data":
        data.write_bytes(data.read_bytes()[:10])
    elif tear == "garbage index":
        index.write_bytes(b"not an index")
    else:
        data.unlink()
    fresh, restored, _ = store_of(tmp_path)
    with caplog.at_level(python_logging.WARNING):
        assert checkpoint_number(fresh.restore_newest()) == 4
    assert restored.numpy().tolist() == [4.0] * 3
    assert "ckpt-8 cannot be read" in caplog.text


def test_every_checkpoint_unreadable_is_one_line(tmp_path):
    store, variable, position = store_of(tmp_path)
    save_steps(store, variable, position, [4])
    (tmp_path / "ckpt-4.index").write_bytes(b"x")
    with pytest.raises(ConfigError, match="none of the 1 checkpoints in .* can be read"):
        store_of(tmp_path)[0].restore_newest()


def test_a_checkpoint_of_another_model_is_one_line(tmp_path):
    store, variable, position = store_of(tmp_path)
    save_steps(store, variable, position, [4])
    other, _, _ = store_of(tmp_path, shape=(5,))
    with pytest.raises(ConfigError, match="does not fit this model and optimizer"):
        other.restore_newest()


def test_a_process_that_is_not_the_writer_leaves_no_files(tmp_path):
    shared = tmp_path / "shared"
    writer, variable, position = store_of(shared)
    save_steps(writer, variable, position, [4])
    reader, other_variable, other_position = store_of(shared, is_writer=False)
    scratch = reader._manager.directory
    other_position.move_to(0, 8, 8)
    other_position.record()
    path = reader.save(8)
    assert path == str(shared / "ckpt-8")
    assert [checkpoint_number(p) for p in reader.candidates()] == [4]  # only the writer's
    reader.close()
    assert not tf.io.gfile.exists(scratch)


def test_position_describes_itself_for_people():
    position = TrainingPosition()
    position.move_to(1, 5, 17)
    assert position.describe() == "epoch 2, step 5 (step 17 in all)"
    position.move_to(2, 0, 24)
    assert position.describe() == "the end of epoch 2 (step 24 in all)"


def test_a_checkpoint_of_a_newer_format_is_one_line(tmp_path, monkeypatch):
    # In this process: a checkpoint whose format number is above this tfdist's, as a newer
    # tfdist would write it, is refused before any of its state is used.
    import keras
    import tensorflow as tf

    import tfdist
    # The reader (backup) binds the format number it reads up to at its import, before the
    # writer's is raised below.
    from tfdist.resume import backup, checkpointing

    def fit(epochs):
        runner = tfdist.Runner(tfdist.load_config(overrides={"strategy": "one_device"}))
        data = runner.dataset(tf.data.Dataset.from_tensor_slices(
            (np.zeros((16, 3), "float32"), np.zeros((16,), "float32"))), 8)
        with runner.scope():
            # Named: a restarted program's model has the names the saved one had.
            model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1, name="out")],
                                     name="model")
            model.compile(runner.optimizer("sgd"), "mse")
        model.fit(data, epochs=epochs, verbose=0,
                  callbacks=runner.callbacks(checkpoint_dir=tmp_path))

    with monkeypatch.context() as newer:
        newer.setattr(checkpointing, "FORMAT_VERSION", checkpointing.FORMAT_VERSION + 1)
        fit(1)
    assert backup.FORMAT_VERSION == checkpointing.FORMAT_VERSION
    with pytest.raises(tfdist.ConfigError) as raised:
        fit(2)
    assert str(raised.value).startswith(
        f"checkpoint {tmp_path / 'ckpt-2'} was written by a newer tfdist (format "
        f"{checkpointing.FORMAT_VERSION + 1}, this one reads up to "
        f"{checkpointing.FORMAT_VERSION}); upgrade tfdist to resume it")
