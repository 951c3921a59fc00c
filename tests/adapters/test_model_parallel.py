"""Model parallelism composed with data parallelism, and its checkpoints, in real processes.

Under `mpirun -np 2` (strategy horovod) each rank holds one copy of the model over its
own 2 logical CPU devices (a Pipeline, or a Column/RowParallelDense pair), the ranks
data-parallel: every rank equals plain one-device Keras on the global batch. Under
one_device, a pipelined run SIGKILLed after a checkpoint and resumed equals one device.
One launch trains both models (`--variants`).
"""

import json
import sys

import keras
import numpy as np
import pytest

from tests.conftest import REPO, mpirun, run_command
from tests.reference import largest_difference

pytestmark = [pytest.mark.xdist_group("adapters_model_parallel"), pytest.mark.multiprocess]

SCRIPT = str(REPO / "tests" / "scripts" / "parallel_training.py")
TOLERANCE = 1e-5
sys.path.insert(0, str(REPO / "tests" / "scripts"))
import parallel_training as job  # noqa: E402

MODELS = ["pipeline", "tensor"]


def rank_files(folder, rank):
    report = json.loads((folder / f"rank{rank}.json").read_text())
    archive = np.load(folder / f"rank{rank}.npz")
    return report, [archive[f"arr_{index}"] for index in range(len(archive.files))]


_references = {}


def one_device(model):
    """Plain Keras on one device, no tfdist, on the global batches in order."""
    if model not in _references:
        keras.backend.clear_session()
        made = job.plain_model(model)
        made.set_weights(job.initial_weights(model))
        made.compile(keras.optimizers.Adam(0.01), "mse")
        features, labels = job.examples()
        made.fit(features, labels, batch_size=job.GLOBAL_BATCH, epochs=2, shuffle=False,
                 verbose=0)
        _references[model] = made.get_weights()
    return _references[model]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("model_parallel_2")
    variants = {model: [f"--model={model}"] for model in MODELS}
    result = run_command(mpirun(sys.executable, SCRIPT, str(out), "--variants",
                                json.dumps(variants)), cwd=out, timeout=300)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    return out


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """A one_device pipeline run checkpointing every 2 steps, SIGKILLed after step 5 (the
    newest checkpoint: step 4), then the same command again."""
    out = tmp_path_factory.mktemp("model_parallel_resume")
    common = [sys.executable, SCRIPT, str(out / "run"), "--strategy=one_device",
              "--model=pipeline", f"--checkpoint_dir={out / 'checkpoints'}",
              "--save_every_steps=2"]
    killed = run_command([*common, "--kill_at_step=5"], cwd=out, timeout=120)
    assert killed.returncode == -9, (killed.stdout + killed.stderr)[-3000:]
    assert not (out / "run" / "rank0.json").exists()
    again = run_command(common, cwd=out, timeout=120)
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    return out / "run"


@pytest.mark.requires_mpi
@pytest.mark.requires_horovod
@pytest.mark.parametrize("model", MODELS)
def test_every_rank_equals_one_device_on_the_global_batch(two_ranks, model):
    for rank in (0, 1):
        report, weights = rank_files(two_ranks / model, rank)
        assert (report["ranks"], report["iterations"]) == (2, 2 * job.STEPS)
        assert largest_difference(weights, one_device(model)) < TOLERANCE, (model, rank)


@pytest.mark.requires_mpi
@pytest.mark.requires_horovod
@pytest.mark.parametrize("model", MODELS)
def test_each_rank_spreads_its_copy_over_its_own_two_devices(two_ranks, model):
    for rank in (0, 1):
        report, _ = rank_files(two_ranks / model, rank)
        assert report["variable_devices"] == report["slot_devices"] == ["CPU:0", "CPU:1"]


def test_a_killed_pipeline_resumes_from_its_checkpoint_and_equals_one_device(resumed):
    report, weights = rank_files(resumed, 0)
    assert report["iterations_at_start"] == 4  # The newest checkpoint, not a fresh start.
    assert report["iterations"] == 2 * job.STEPS
    assert largest_difference(weights, one_device("pipeline")) < TOLERANCE
