"""Fault tolerance with real processes: crashes, preemption, stuck peers, Horovod elastic.

Every scenario runs `tests/scripts/resumable_training.py` (3 epochs of 12 steps, Adam,
Dropout, a shuffle seeded by (seed, epoch), a checkpoint every 4 steps; every process
records the example ids of each step it trains, to its own file) and compares it
with an uninterrupted run of the same configuration:

- the weights are equal (within 1e-6 in one process, 1e-5 across processes);
- `optimizer.iterations` is 36;
- the ids of every step are the uninterrupted run's, and each restart starts at the
  step after its checkpoint: only the steps after the last checkpoint are redone.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import REPO, TFDIST, horovodrun, launcher_command, run_command

SCRIPT = str(REPO / "tests" / "scripts" / "resumable_training.py")
STEPS, EPOCHS = 12, 3
IN_PROCESS, ACROSS_PROCESSES = 1e-6, 1e-5
TASKS = {"one_device": ["main"], "mirrored": ["main"], "multi_worker": ["worker0", "worker1"],
         "horovod": ["rank0", "rank1"]}

# --- running the script ---------------------------------------------------------------------


# How long one launch may take before the test calls it a hang: a bound, not a timing.
# Alone a launch here takes 20-60 s; under the suite's load (3 tests at a time on 2 cores)
# Horovod launches reached 120 s, the bound they had, and failed with nothing wrong. A
# deadlock is caught sooner anyway: Horovod's stall shutdown (40 s in tests/conftest.py) and
# the collectives' timeouts turn it into an error.
LAUNCH_BOUND_SECONDS = 300


def script(out, strategy, *args, checkpoint_dir=None):
    return [sys.executable, SCRIPT, str(out), "--strategy", strategy,
            "--checkpoint_dir", str(checkpoint_dir or Path(out) / "ckpt"), *args]


def run_alone(out, strategy, *args, expect=0, **kwargs):
    """One process (one_device, mirrored); returns the completed process."""
    result = run_command(script(out, strategy, *args, **kwargs), cwd=out,
                         timeout=LAUNCH_BOUND_SECONDS)
    assert result.returncode == expect, result.stderr[-3000:]
    return result


def launch(out, *args, workers=2, ps=0, restarts=0, expect=0, timeout=LAUNCH_BOUND_SECONDS):
    """`tfdist launch` of the script; returns the completed process."""
    command = [TFDIST, "launch", "-n", str(workers), "--max_restarts", str(restarts)]
    if ps:
        command += ["--ps", str(ps)]
    result = run_command([*command, "--", *args], cwd=out, timeout=timeout)
    assert result.returncode == expect, result.stdout[-4000:]
    return result


def horovod(out, launcher, *args, expect=0, supervised=False):
    """Two ranks under mpirun or horovodrun --gloo; with `supervised`, under `tfdist
    supervise`, whose status is asserted exactly (the launchers' own is 1 for most
    failures)."""
    command = launcher_command(launcher, *args)
    if supervised:
        command = [TFDIST, "supervise", "--", *command]
    result = run_command(command, cwd=out, timeout=LAUNCH_BOUND_SECONDS)
    output = (result.stdout + result.stderr)[-4000:]
    if supervised:
        assert result.returncode == expect, output
    else:
        assert (result.returncode == 0) == (expect == 0), output
    return result


# --- what the processes wrote ----------------------------------------------------------------


def attempts(out, task):
    """Each start's records of `task`, in order: [[{epoch, step, ids}, ...], ...]."""
    found = sorted(Path(out).glob(f"steps-{task}-*.jsonl"),
                   key=lambda path: int(path.stem.rsplit("-", 1)[1]))
    return [[json.loads(line) for line in path.read_text().splitlines()] for path in found]


def first_steps(out, task):
    """(epoch, step) of each start's first trained step (None: it trained none)."""
    return [(records[0]["epoch"], records[0]["step"]) if records else None
            for records in attempts(out, task)]


def stitched(out, task):
    """The steps as training saw them: a later start replaces the steps it redoes."""
    steps = []
    for records in attempts(out, task):
        if records:
            first = (records[0]["epoch"], records[0]["step"])
            steps = [r for r in steps if (r["epoch"], r["step"]) < first] + records
    return steps


def final(out, task):
    return json.loads((Path(out) / f"final-{task}.json").read_text())


def weights(out):
    arrays = np.load(Path(out) / "weights.npz")
    return [arrays[f"arr_{i}"] for i in range(len(arrays.files))]


def max_difference(a, b):
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))


def assert_same_training(run, reference, tasks, tolerance, updates=STEPS * EPOCHS):
    """The interrupted run trained on what the uninterrupted one did, and ends the same."""
    for task in tasks:
        expected = attempts(reference, task)[0]
        assert expected and stitched(run, task) == expected, task
        assert final(run, task)["iterations"] == updates
        # The last start's epochs log what the uninterrupted run logged: a resumed epoch's
        # metrics went on from their saved totals.
        logged, uninterrupted = final(run, task)["history"], final(reference, task)["history"]
        for key, values in logged.items():
            assert np.allclose(values, uninterrupted[key][len(uninterrupted[key]) - len(values):],
                               rtol=0, atol=tolerance), key
    assert max_difference(weights(run), weights(reference)) < tolerance


# --- the uninterrupted runs, each made once per session ----------------------------------


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """reference(strategy, *args): the folder of an uninterrupted run, made once per
    session, even when pytest-xdist spreads this module's tests over several workers."""
    base = tmp_path_factory.getbasetemp()
    # Each xdist worker has a base of its own inside the session's; the runs go there.
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base

    def get(strategy, *args, launcher="mpirun"):
        key = hashlib.sha1(json.dumps([strategy, launcher, *args]).encode()).hexdigest()[:10]
        out = shared / f"reference-{strategy}-{key}"
        with open(shared / f"{out.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # a worker needing the same run waits for it
            if not (out / "made").exists():
                shutil.rmtree(out, ignore_errors=True)
                out.mkdir()
                command = script(out, strategy, *args)
                if strategy in ("one_device", "mirrored"):
                    run_command(command, cwd=out,
                                timeout=LAUNCH_BOUND_SECONDS).check_returncode()
                elif strategy == "horovod":
                    horovod(out, launcher, *command)
                else:
                    launch(out, *command)
                (out / "made").write_text("")
        return out

    return get


def scratch_folders():
    # The processes' temporary folder: this test's own (conftest's private_tmpdir).
    return {path.name for path in Path(os.environ["TMPDIR"]).glob("tfdist-not-chief-*")}


# --- crashes ------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["one_device", "mirrored", "multi_worker"])
@pytest.mark.multiprocess
def test_sigkill_mid_epoch_resumes_at_the_step_after_the_checkpoint(strategy, reference,
                                                                    tmp_path):
    # SIGKILL at step 6 of the second epoch; the last checkpoint is at its step 4.
    kill = ["--kill", f"{TASKS[strategy][-1]}@1:6"]
    if strategy == "multi_worker":
        launch(tmp_path, *script(tmp_path, strategy, *kill), restarts=1)
    else:
        run_alone(tmp_path, strategy, *kill, expect=-9)
        run_alone(tmp_path, strategy, *kill)
    for task in TASKS[strategy]:
        assert first_steps(tmp_path, task) == [(0, 1), (1, 5)]
        assert final(tmp_path, task)["iterations_at_start"] == [16]
    assert_same_training(tmp_path, reference(strategy), TASKS[strategy],
                         ACROSS_PROCESSES if strategy == "multi_worker" else IN_PROCESS)


@pytest.mark.multiprocess
def test_a_second_crash_right_after_the_resume_resumes_after_the_newer_checkpoint(
        reference, tmp_path):
    # The first start dies at step 6, the second at step 8 (after saving step 8).
    kills = ["--kill", "main@1:6", "--kill", "main@1:8"]
    run_alone(tmp_path, "one_device", *kills, expect=-9)
    run_alone(tmp_path, "one_device", *kills, expect=-9)
    run_alone(tmp_path, "one_device", *kills)
    assert first_steps(tmp_path, "main") == [(0, 1), (1, 5), (1, 9)]
    assert_same_training(tmp_path, reference("one_device"), ["main"], IN_PROCESS)


@pytest.mark.multiprocess
def test_a_kill_inside_a_save_and_a_torn_newest_checkpoint_fall_back(reference, tmp_path):
    # Killed inside the save of step 20 (epoch 2, step 8): its files are written, but the
    # folder's state file does not name them yet. The restart finds the checkpoint by its
    # own files, whole, and resumes from step 20.
    run_alone(tmp_path, "one_device", "--kill_in_save", "main@20", expect=-9)
    resumed = run_alone(tmp_path, "one_device", "--kill_in_save", "main@20")
    assert f"resuming from {tmp_path / 'ckpt' / 'ckpt-20'}" in resumed.stderr
    assert first_steps(tmp_path, "main") == [(0, 1), (1, 9)]
    assert_same_training(tmp_path, reference("one_device"), ["main"], IN_PROCESS)
    # Then the newest checkpoint is torn: the next start passes over it, with a warning.
    newest = tmp_path / "ckpt" / "ckpt-36.data-00000-of-00001"
    newest.write_bytes(newest.read_bytes()[:100])
    fallen_back = run_alone(tmp_path, "one_device")
    assert "ckpt-36 cannot be read" in fallen_back.stderr
    assert f"resuming from {tmp_path / 'ckpt' / 'ckpt-32'}" in fallen_back.stderr
    assert first_steps(tmp_path, "main")[-1] == (2, 9)
    assert_same_training(tmp_path, reference("one_device"), ["main"], IN_PROCESS)


@pytest.mark.multiprocess
def test_keras_backup_and_restore_replays_the_interrupted_epoch(reference, tmp_path):
    # The bare stack on the same scenario: Keras 3's own callback saves every 4 steps but
    # restarts the epoch from its first batch, on weights that have seen its first 4.
    kill = ["--keras_backup", "--kill", "main@1:6"]
    run_alone(tmp_path, "one_device", *kill, expect=-9)
    run_alone(tmp_path, "one_device", *kill)
    assert first_steps(tmp_path, "main") == [(0, 1), (1, 1)]
    assert final(tmp_path, "main")["iterations"] == 36 + 4  # steps 1-4 of epoch 2, twice
    assert max_difference(weights(tmp_path), weights(reference("one_device"))) > 1e-3


TUTORIAL = str(REPO / "tests" / "scripts" / "keras_backup_tutorial.py")


@pytest.mark.multiprocess
def test_the_multi_worker_tutorials_keras_backup_and_restore_survives_a_kill(tmp_path):
    # TensorFlow's tutorial cell: Keras's own BackupAndRestore(save_freq=30), 3 epochs of
    # 70 steps, 2 workers. Worker 1 is killed at step 40 of the second epoch; the group
    # restarts and trains to the end. Keras resumes at the start of the interrupted epoch
    # (its backup at step 90 says epoch 1), so its 20 steps before the backup run twice.
    before = scratch_folders()
    # Two starts of a 2-worker cluster and 230 steps: 44-75 s alone, over 150 s under the
    # suite's load (3 test workers on 2 cores). The bound is there to end a hang, not to time
    # the run.
    result = launch(tmp_path, sys.executable, TUTORIAL, str(tmp_path / "out"),
                    str(tmp_path / "backup"), "--kill", "worker:1@1:40", restarts=1,
                    timeout=420)
    assert (tmp_path / "out" / "killed").exists()
    for task in ("worker-0", "worker-1"):
        report = json.loads((tmp_path / "out" / f"{task}-0.json").read_text())
        assert report == {"epochs": [1, 2], "iterations": 3 * 70 + 20}, task
    assert not (tmp_path / "backup").exists()  # deleted at the end, by the chief alone
    # Worker 1's private copies are removed at its exit; the killed start's stays (SIGKILL
    # runs no exit handler).
    assert len(scratch_folders() - before) <= 1
    assert "Traceback" not in result.stdout.split("restarting")[-1]


@pytest.mark.multiprocess
def test_keras_backup_and_restore_without_the_fix_crashes_at_a_backup(tmp_path):
    # Keras 3 as installed: both workers write the same files (7 of 7 runs crashed here).
    result = launch(tmp_path, sys.executable, TUTORIAL, str(tmp_path / "out"),
                    str(tmp_path / "backup"), "--undo", expect=1)
    assert "FileExistsError" in result.stdout or "unable to lock file" in result.stdout


# --- the user's own shuffle -----------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["multi_worker", "horovod"])
@pytest.mark.multiprocess
def test_a_resume_with_the_users_own_seeded_shuffle_is_exact(strategy, reference, tmp_path):
    # `dataset.shuffle(n, seed=3)` in the pipeline, reshuffled each epoch (tf.data's
    # default), with Dropout: a kill at step 6 of the second epoch, and a restart. A new
    # process's shuffle would start again at its first order; the resumed epoch gets its own.
    shuffle = ["--user_shuffle", "3"]
    kill = ["--kill", f"{TASKS[strategy][-1]}@1:6"]
    if strategy == "multi_worker":
        result = launch(tmp_path, *script(tmp_path, strategy, *shuffle, *kill), restarts=1)
        output = result.stdout
    else:
        horovod(tmp_path, "mpirun", *script(tmp_path, strategy, *shuffle, *kill), expect=137)
        output = horovod(tmp_path, "mpirun", *script(tmp_path, strategy, *shuffle, *kill)).stderr
    assert "resuming from" in output and "has no seed" not in output
    uninterrupted = reference(strategy, *shuffle)
    orders = [[record["ids"] for record in attempts(uninterrupted, TASKS[strategy][0])[0]
               if record["step"] == 1 and record["epoch"] == epoch] for epoch in range(EPOCHS)]
    assert orders[0] != orders[1] != orders[2]  # the pipeline reshuffles every epoch
    for task in TASKS[strategy]:
        assert first_steps(tmp_path, task) == [(0, 1), (1, 5)]
    assert_same_training(tmp_path, uninterrupted, TASKS[strategy], IN_PROCESS)


@pytest.mark.multiprocess
def test_a_resume_with_an_unseeded_shuffle_says_its_order_differs(tmp_path):
    kill = ["--user_shuffle", "unseeded", "--kill", "main@1:6"]
    run_alone(tmp_path, "one_device", *kill, expect=-9)
    result = run_alone(tmp_path, "one_device", *kill)
    notices = [line for line in result.stderr.splitlines() if "has no seed" in line]
    assert notices == ["tfdist: a shuffle in the input pipeline has no seed, so the resumed "
                       "epoch's order differs from the interrupted run's; give it one "
                       "(dataset.shuffle(n, seed=...)), or shuffle with "
                       "runner.dataset(..., shuffle_buffer_size=n)"]


# --- preemption -------------------------------------------------------------------------------


@pytest.mark.parametrize("signalled", ["worker1", "worker0"])
@pytest.mark.multiprocess
def test_sigterm_to_one_worker_stops_both_at_one_step_and_resumes(signalled, reference,
                                                                  tmp_path):
    # Accumulation 2: 24 micro-batches per epoch, an update every 2. The signal at the end
    # of step 5 of epoch 2: both workers stop at step 7, in the middle of a cycle.
    out, scratch = tmp_path / "out", scratch_folders()
    folders = [tmp_path / f"w{index}" for index in (0, 1)]
    for folder in (out, *folders):
        folder.mkdir()
    # Each worker runs in a folder of its own: a file left by a worker would show there.
    in_own_folder = ("import json, os, subprocess, sys; "
                     "index = json.loads(os.environ['TF_CONFIG'])['task']['index']; "
                     f"os.chdir({str(tmp_path)!r} + f'/w{{index}}'); "
                     "sys.exit(subprocess.call(sys.argv[1:]))")
    command = script(out, "multi_worker", "--accumulation_steps", "2",
                     "--sigterm", f"{signalled}@1:5", checkpoint_dir=tmp_path / "ckpt")
    result = launch(tmp_path, sys.executable, "-c", in_own_folder, *command, restarts=1)
    assert "exited with status 143 (saved for a restart)" in result.stdout
    for task in TASKS["multi_worker"]:
        first, second = attempts(out, task)
        assert (first[-1]["epoch"], first[-1]["step"]) == (1, 7)
        assert (second[0]["epoch"], second[0]["step"]) == (1, 8)
    assert_same_training(out, reference("multi_worker", "--accumulation_steps", "2"),
                         TASKS["multi_worker"], ACROSS_PROCESSES)
    assert [list(folder.iterdir()) for folder in folders] == [[], []]
    assert not scratch_folders() - scratch
    # Only the checkpoints and the run's record (run.json); no one's temporary files.
    assert {path.suffix or path.name for path in (tmp_path / "ckpt").iterdir()} == {
        "checkpoint", ".index", ".data-00000-of-00001", ".json"}


@pytest.mark.requires_mpi
@pytest.mark.requires_horovod
@pytest.mark.parametrize("launcher", ["mpirun", "horovodrun"])
@pytest.mark.multiprocess
def test_sigterm_then_a_crash_mid_cycle_under_horovod_resume_exactly(launcher, reference,
                                                                     tmp_path):
    # Accumulation 2 (an update every 2 of the 24 micro-batches of an epoch), a save every
    # 3 micro-batches. First start: SIGTERM to rank 1 at the end of step 4 of epoch 2; the
    # vote rides with the next update, so both ranks stop at step 6 and save. Second start:
    # rank 0 is killed at step 4 of epoch 3; the last save, at its step 3, is in the middle
    # of a cycle, with each rank's half of that cycle's gradients (saved summed).
    # The first start is under `tfdist supervise`: the ranks' 143 is its status, where
    # horovodrun --gloo itself exits with 1.
    command = script(tmp_path, "horovod", "--accumulation_steps", "2", "--save_every", "3",
                     "--sigterm", "rank1@1:4", "--kill", "rank0@2:4")
    horovod(tmp_path, launcher, *command, expect=143, supervised=True)
    horovod(tmp_path, launcher, *command, expect=137)
    horovod(tmp_path, launcher, *command)
    for task in TASKS["horovod"]:
        assert first_steps(tmp_path, task) == [(0, 1), (1, 7), (2, 4)]
    assert_same_training(tmp_path, reference("horovod", "--accumulation_steps", "2"),
                         TASKS["horovod"], ACROSS_PROCESSES)


@pytest.mark.requires_mpi
@pytest.mark.requires_horovod
@pytest.mark.parametrize("launcher", ["mpirun", "horovodrun"])
@pytest.mark.multiprocess
def test_sigterm_to_tfdist_supervise_lets_the_ranks_save_and_exits_143(launcher, reference,
                                                                       tmp_path):
    # What a scheduler does to a Horovod job: SIGTERM to its first process. mpirun would
    # kill the ranks a second later and exit 1; horovodrun --gloo gives them 5 s and exits
    # 1. tfdist supervise passes the signal to the ranks instead. The signal comes while
    # rank 0 stalls (3 s, in Python) after step 4 of epoch 2: both ranks stop together
    # at a later step, save, and the rerun resumes exactly.
    command = script(tmp_path, "horovod", "--accumulation_steps", "2",
                     "--stall_at", "rank0@1:4:3")
    supervised = [TFDIST, "supervise", "--", *launcher_command(launcher, *command)]
    with open(tmp_path / "supervise.log", "w") as log:
        process = subprocess.Popen(supervised, cwd=tmp_path, stdout=log,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
        try:
            deadline = time.monotonic() + 90
            while not (tmp_path / "stalled-rank0.json").exists():
                assert process.poll() is None and time.monotonic() < deadline, \
                    (tmp_path / "supervise.log").read_text()[-4000:]
                time.sleep(0.1)
            process.send_signal(signal.SIGTERM)
            status = process.wait(timeout=60)
        finally:
            process.kill()
    assert status == 143, (tmp_path / "supervise.log").read_text()[-4000:]
    stops = {(attempts(tmp_path, task)[0][-1]["epoch"], attempts(tmp_path, task)[0][-1]["step"])
             for task in TASKS["horovod"]}
    assert len(stops) == 1 and (stop := stops.pop()) > (1, 4), stops
    horovod(tmp_path, launcher, *command)
    for task in TASKS["horovod"]:
        assert first_steps(tmp_path, task) == [(0, 1), (stop[0], stop[1] + 1)]
    assert_same_training(tmp_path, reference("horovod", "--accumulation_steps", "2"),
                         TASKS["horovod"], ACROSS_PROCESSES)


@pytest.mark.multiprocess
def test_parameter_servers_sigterm_to_the_chief_resumes_with_exact_iterations(tmp_path):
    command = script(tmp_path, "parameter_server", "--sigterm", "chief0@1:6")
    result = launch(tmp_path, *command, ps=1, restarts=1)
    assert "chief:0 exited with status 143 (saved for a restart)" in result.stdout
    report = final(tmp_path, "chief0")
    assert report["attempt"] == 1
    assert report["iterations_at_start"] == [12 + 7]  # stopped at step 7 of epoch 2
    assert report["iterations"] == 36
    assert len(report["history"]["loss"]) == 2  # epochs 2 and 3


@pytest.mark.multiprocess
def test_a_signal_in_the_first_trace_in_validation_and_at_the_last_step(reference, tmp_path):
    # Three starts end by SIGTERM: during the first trace (to worker 1), during epoch 2's
    # validation (to worker 0) and at the very last step (to worker 1). The fourth start
    # finds the run finished and trains no step.
    faults = ["--validation", "--sigterm_in_trace", "worker1",
              "--sigterm_in_validation", "worker0@1", "--sigterm", "worker1@2:12"]
    launch(tmp_path, *script(tmp_path, "multi_worker", *faults), restarts=3)
    for task in TASKS["multi_worker"]:
        # Stopped after step 2 (the signal came before step 1's end), at the end of
        # epoch 2 (its validation done), at the end of epoch 3.
        assert first_steps(tmp_path, task) == [(0, 1), (0, 3), (2, 1), None]
        assert final(tmp_path, task)["history"] == {}  # no epoch left to train
    # Validation changes nothing in training: the reference without it serves.
    assert_same_training(tmp_path, reference("multi_worker"), TASKS["multi_worker"],
                         ACROSS_PROCESSES)


@pytest.mark.multiprocess
def test_three_sigterms_at_seeded_random_steps_over_five_epochs(reference, tmp_path):
    import random

    rng = random.Random(20261122)
    faults = []
    for epoch in sorted(rng.sample(range(5), 3)):  # one per epoch: each ends its own start
        faults += ["--sigterm", f"worker{rng.randrange(2)}@{epoch}:{rng.randint(1, STEPS)}"]
    launch(tmp_path, *script(tmp_path, "multi_worker", "--epochs", "5", *faults), restarts=3)
    for task in TASKS["multi_worker"]:
        assert len(attempts(tmp_path, task)) == 4
    assert_same_training(tmp_path, reference("multi_worker", "--epochs", "5"),
                         TASKS["multi_worker"], ACROSS_PROCESSES, updates=5 * STEPS)


# --- no hangs -------------------------------------------------------------------------------


@pytest.mark.multiprocess
def test_a_stuck_peer_ends_the_run_within_the_default_timeout(tmp_path):
    from tfdist.config import DEFAULT_COLLECTIVE_TIMEOUT_SECONDS

    # Worker 1 blocks in Python for 120 s after step 3 of epoch 2, alive but not training.
    # The bare stack (no timeout) runs beside, to show it still waiting.
    stall = ["--stall_at", "worker1@1:3:120"]
    bare_out, out = tmp_path / "bare", tmp_path / "tfdist"
    bare_out.mkdir()
    out.mkdir()
    bare = subprocess.Popen(
        [TFDIST, "launch", "-n", "2", "--grace_seconds", "2", "--",
         *script(bare_out, "multi_worker", "--bare", *stall)],
        cwd=bare_out, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    try:
        launch(out, *script(out, "multi_worker", *stall), expect=1)
        stalled = json.loads((out / "stalled-worker1.json").read_text())["at"]
        error = json.loads((out / "error-worker0.json").read_text())
        assert error["type"] == "DeadlineExceededError"
        assert "Collective has timed out" in error["message"]
        assert error["at"] - stalled <= DEFAULT_COLLECTIVE_TIMEOUT_SECONDS + 5
        bare_stalled = bare_out / "stalled-worker1.json"
        deadline = time.time() + 60
        while not bare_stalled.exists() and time.time() < deadline:
            time.sleep(0.5)
        stalled_at = json.loads(bare_stalled.read_text())["at"]
        time.sleep(max(0.0, stalled_at + 60 - time.time()))
        assert bare.poll() is None  # 60 s on: still running,
        steps = attempts(bare_out, "worker0")[0]
        assert (steps[-1]["epoch"], steps[-1]["step"]) == (1, 3)  # and no step since
        assert not list(bare_out.glob("error-*")) and not list(bare_out.glob("final-*"))
    finally:
        bare.terminate()
        bare.wait(timeout=30)


# --- Horovod elastic ------------------------------------------------------------------------


@pytest.mark.requires_mpi
@pytest.mark.requires_horovod
@pytest.mark.multiprocess
def test_horovod_elastic_goes_on_with_the_rank_left(reference, tmp_path):
    # Two "hosts" on this machine, one slot each: the rank on 127.0.0.1 is SIGKILLed at
    # step 6 of epoch 2; Horovod's driver drops that host, and rank 0 resumes alone from
    # the last commit (step 4), with the whole global batch and the learning rate for 1.
    command = script(tmp_path, "horovod", "--elastic", "--scale_learning_rate",
                     "--kill", "rank1@1:6")
    result = run_command(horovodrun("--min-np", "1", *command, hosts="localhost:1,127.0.0.1:1"),
                         cwd=tmp_path, timeout=LAUNCH_BOUND_SECONDS)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    report = final(tmp_path, "rank0")
    assert [start["replicas"] for start in report["starts"]] == [2, 1]
    assert [round(start["learning_rate"], 6) for start in report["starts"]] == [0.02, 0.01]
    assert report["iterations"] == 36
    expected = {(r["epoch"], r["step"]): r["ids"][0]
                for r in attempts(reference("one_device"), "main")[0]}
    records = attempts(tmp_path, "rank0")[0]
    halves = [r for r in records if len(r["ids"][0]) == 8]   # with 2 ranks: rank 0's half
    wholes = [r for r in records if len(r["ids"][0]) == 16]  # alone: the global batch
    assert (halves[-1]["epoch"], halves[-1]["step"]) == (1, 6)
    assert (wholes[0]["epoch"], wholes[0]["step"]) == (1, 5)  # from the commit on
    assert len(halves) == 18 and len(wholes) == 20
    assert all(r["ids"][0] == expected[(r["epoch"], r["step"])][:8] for r in halves)
    assert all(r["ids"][0] == expected[(r["epoch"], r["step"])] for r in wholes)


@pytest.mark.parametrize("strategy, option", [
    # (Keras 3 fails steps_per_execution > 1 under MirroredStrategy, keras-team/keras#19246.)
    ("one_device", ["--steps_per_execution", "3"]),
    ("one_device", ["--precision", "mixed_float16"])])
@pytest.mark.multiprocess
def test_a_resume_is_exact_with_steps_per_execution_and_loss_scaling(strategy, option,
                                                                     reference, tmp_path):
    # 3 steps per execution: saves fall at the first execution end at or after each 4th
    # step; the one before the kill at step 6 of epoch 2 is at its step 6 (step 18).
    # mixed_float16: the loss scale and its growth counter resume too.
    kill = ["--kill", "main@1:6", *option]
    run_alone(tmp_path, strategy, *kill, expect=-9)
    run_alone(tmp_path, strategy, *kill)
    # Records are per execution, named by its last step: with 3 per execution the resumed
    # start's first execution is steps 7-9.
    expected = [(0, 3), (1, 9)] if "--steps_per_execution" in option else [(0, 1), (1, 5)]
    assert first_steps(tmp_path, "main") == expected
    assert_same_training(tmp_path, reference(strategy, *option), ["main"], IN_PROCESS)


def test_a_later_fit_of_the_same_model_starts_at_epoch_0(tmp_path):
    # In this process: a fit that resumed at epoch 2 leaves no stale start behind.
    import keras
    import tensorflow as tf

    import tfdist

    runner = tfdist.Runner(tfdist.load_config(overrides={"strategy": "one_device"}))
    data = runner.dataset(tf.data.Dataset.from_tensor_slices(
        (np.zeros((32, 3), "float32"), np.zeros((32,), "float32"))), 8)
    with runner.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(runner.optimizer("sgd"), "mse")
    model.fit(data, epochs=2, verbose=0, callbacks=runner.callbacks(checkpoint_dir=tmp_path))
    resumed = model.fit(data, epochs=3, verbose=0,
                        callbacks=runner.callbacks(checkpoint_dir=tmp_path))
    assert resumed.epoch == [2]  # resumed after epoch 2 of 3
    again = model.fit(data, epochs=2, verbose=0)
    assert again.epoch == [0, 1] and model._initial_epoch is None
