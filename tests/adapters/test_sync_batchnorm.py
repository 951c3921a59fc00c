"""BatchNormalization(synchronized=True) normalises over the global batch under every
synchronous strategy: a convolutional model trains as on one device (1e-5)."""

import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tests import reference
from tests.conftest import REPO, TFDIST, mpirun, run_command

SCRIPT = str(REPO / "tests" / "scripts" / "sync_batchnorm_training.py")
sys.path.insert(0, str(REPO / "tests" / "scripts"))
import sync_batchnorm_training as job  # noqa: E402


def one_device_weights():
    keras.backend.clear_session()
    model = reference.make_conv_model()
    model.set_weights(reference.initial_conv_weights())
    model.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy")
    data = tf.data.Dataset.from_tensor_slices(reference.images(job.GLOBAL_BATCH * job.STEPS))
    model.fit(data.batch(job.GLOBAL_BATCH), epochs=job.EPOCHS, verbose=0)
    return model.get_weights()


def saved_weights(out_dir):
    return {rank: [array for _, array in sorted(
        np.load(out_dir / f"rank{rank}.npz").items(), key=lambda item: int(item[0][2:]))]
        for rank in (0, 1)}


def run_processes(command, tmp_path):
    result = run_command(command, cwd=tmp_path, timeout=120)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    return saved_weights(tmp_path)


@pytest.fixture(scope="module")
def expected():
    return one_device_weights()


def test_mirrored_2_replicas_equals_one_device(expected):
    runner = tfdist.Runner(tfdist.load_config(overrides={
        "strategy": "mirrored", "mirrored.cpu_replicas": 2}))
    with runner.scope():
        model = reference.make_conv_model()
        model.set_weights(reference.initial_conv_weights())
        model.compile(runner.optimizer(keras.optimizers.SGD(0.1)),
                      "sparse_categorical_crossentropy")
    data = tf.data.Dataset.from_tensor_slices(reference.images(job.GLOBAL_BATCH * job.STEPS))
    model.fit(runner.dataset(data, job.GLOBAL_BATCH), epochs=job.EPOCHS, verbose=0)
    assert reference.largest_difference(model.get_weights(), expected) < reference.TOLERANCE


@pytest.mark.multiprocess
def test_multi_worker_2_workers_equals_one_device(expected, tmp_path):
    weights = run_processes([TFDIST, "launch", "-n", "2", "--", sys.executable, SCRIPT,
                             str(tmp_path), "--strategy=multi_worker"], tmp_path)
    for rank in (0, 1):
        assert reference.largest_difference(weights[rank], expected) < reference.TOLERANCE


@pytest.mark.parametrize("front_door", ["adapter", "drop_in"])
@pytest.mark.requires_mpi
@pytest.mark.requires_horovod
@pytest.mark.multiprocess
def test_horovod_2_ranks_equals_one_device(front_door, expected, tmp_path):
    weights = run_processes(mpirun(sys.executable, SCRIPT, str(tmp_path), "--strategy=horovod",
                                   *(["--drop_in"] if front_door == "drop_in" else [])),
                            tmp_path)
    for rank in (0, 1):
        assert reference.largest_difference(weights[rank], expected) < reference.TOLERANCE


@pytest.mark.requires_mpi
@pytest.mark.requires_horovod
@pytest.mark.multiprocess
def test_without_the_fix_each_rank_uses_its_own_statistics(expected, tmp_path):
    # Keras's synchronized moments reach tf.distribute replicas only; Horovod's ranks
    # are not replicas of any strategy.
    weights = run_processes(mpirun(sys.executable, SCRIPT, str(tmp_path), "--strategy=horovod",
                                   "--drop_in", "--without_fix"), tmp_path)
    assert reference.largest_difference(weights[0], expected) > 1e-3
    # The moving statistics are each rank's own.
    moving_mean = 4  # after the conv kernel and bias, gamma and beta
    assert reference.largest_difference(weights[0][moving_mean:moving_mean + 1],
                                        weights[1][moving_mean:moving_mean + 1]) > 1e-4
