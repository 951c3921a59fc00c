"""The `tfdist` command and the example script, end to end, as a user runs them."""

import json
import sys

import pytest
import yaml

import tfdist
from tfdist.quiet import is_tensorflow_log_line
from tests.conftest import REPO, TFDIST, last_json_line, run_command

CONTRACT_KEYS = {"strategy", "replicas", "precision", "accumulation_steps", "epochs",
                 "final_loss", "accuracy", "examples_per_sec"}


@pytest.mark.multiprocess
def test_train_as_make_demo_runs_it(tmp_path):
    # As a user runs it: TF_CPP_MIN_LOG_LEVEL unset.
    result = run_command([TFDIST, "train", "--config=mirrored",
                          "--set", "mirrored.cpu_replicas=2", "--set", "train.epochs=3",
                          "--set", "train.output_dir=out"], cwd=tmp_path,
                         env={"TF_CPP_MIN_LOG_LEVEL": None})
    assert result.returncode == 0, result.stderr[-3000:]
    # Quiet: the choice line on stderr; the progress bar and the JSON on stdout.
    assert [line for line in result.stderr.splitlines() if line.strip()] == [
        "tfdist: strategy mirrored (2 replicas; requested), precision float32 (requested)"]
    assert not [line for line in result.stdout.splitlines() if is_tensorflow_log_line(line)]
    summary = last_json_line(result.stdout)
    assert CONTRACT_KEYS <= set(summary)
    assert summary["strategy"] == "mirrored"
    assert summary["replicas"] == 2
    assert summary["precision"] == "float32"
    assert summary["epochs"] == 3
    assert summary["accuracy"] > 0.85  # digits after 3 epochs
    assert summary["examples_per_sec"] > 0
    assert "Epoch 3/3" in result.stdout  # the chief's Keras progress bar
    assert "strategy mirrored (2 replicas; requested)" in result.stderr
    # The chief wrote the resolved config and the result beside each other.
    written = tfdist.load_config(tmp_path / "out" / "config.yaml")
    assert written.strategy is tfdist.Strategy.MIRRORED
    assert written.precision is tfdist.Precision.FLOAT32
    assert json.loads((tmp_path / "out" / "result.json").read_text())["accuracy"] == \
        summary["accuracy"]


@pytest.mark.multiprocess
def test_train_auto_with_bfloat16(tmp_path):
    result = run_command([TFDIST, "train", "--verbose", "--strategy=auto", "--precision=bf16",
                          "--set", "train.epochs=2"], cwd=tmp_path,
                         env={"TF_CPP_MIN_LOG_LEVEL": None})
    assert result.returncode == 0, result.stderr[-3000:]
    # --verbose: TensorFlow's own start-up lines are shown.
    assert [line for line in result.stderr.splitlines() if is_tensorflow_log_line(line)]
    summary = last_json_line(result.stdout)
    assert summary["strategy"] in {"one_device", "mirrored"}  # no TPU or cluster here
    assert f"strategy {summary['strategy']} (1 replica; auto: " in result.stderr  # and why
    assert summary["precision"] == "mixed_bfloat16"
    written = yaml.safe_load((tmp_path / "tfdist_output" / "config.yaml").read_text())
    assert written["strategy"] == summary["strategy"]  # auto is resolved in the saved config


@pytest.mark.multiprocess
def test_train_spreads_the_reference_model_over_two_devices_in_a_pipeline(tmp_path):
    result = run_command([TFDIST, "train", "--strategy=one_device",
                          "--set", "model_parallel.devices=2",
                          "--set", "model_parallel.micro_batches=4", "--set", "train.epochs=3"],
                         cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = last_json_line(result.stdout)
    # 2 hidden Dense layers, the logits and the float32 softmax: cut by parameters.
    assert summary["model_parallel"] == {"devices": ["/device:CPU:0", "/device:CPU:1"],
                                         "micro_batches": 4, "balance": [1, 3]}
    assert summary["accuracy"] > 0.85  # digits after 3 epochs, as without the pipeline


@pytest.mark.multiprocess
def test_env_reports_versions_devices_and_the_auto_choice(tmp_path):
    result = run_command([TFDIST, "env", "--json"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    # Started from a temporary folder, the command imports the tree under test
    # (tests/conftest.py puts it on every started process's PYTHONPATH).
    assert report["tfdist_from"] == str(REPO / "tfdist")
    assert report["versions"]["tensorflow"].startswith("2.21")
    assert report["versions"]["keras"].startswith("3.")
    assert report["cluster"]["cpu_cores"] >= 1
    assert report["auto"]["strategy"] in {s.value for s in tfdist.Strategy}
    assert report["auto"]["why"]
    assert "mirrored" in report["strategies_available"]
    assert report["zero_stage"]["strategies"] == ["one_device", "horovod"]
    assert "strategy horovod" in report["zero_stage"]["refused"]["mirrored"]
    assert report["model_parallel"]["strategies"] == ["one_device", "horovod"]
    assert "tensorflow/tensorflow#33645" in report["model_parallel"]["refused"]["mirrored"]
    patches = {patch["name"]: patch for patch in report["patches"]["all"]}
    assert report["patches"]["active"] == []  # nothing is applied until an adapter is built
    assert patches["keras.variables.atomic_assign_add"]["applied_by"] == ["parameter_server"]
    assert patches["keras.optimizer.slots_beside_their_variables"]["applied_by"] == [
        "tfdist.parallel"]
    assert "tfdist.horovod.keras.init()" in patches[
        "keras.normalization.horovod_synchronized_moments"]["applied_by"]
    probe = report["bfloat16_probe"]  # probed only where the CPU has bfloat16 instructions
    assert probe["probed"] is report["cluster"]["cpu_bf16"]
    if probe["probed"] and not report["cluster"]["gpus"]:
        assert probe["float32_gflops"] > 0 and probe["bfloat16_gflops"] > 0
        assert (report["auto"]["precision"] == "mixed_bfloat16") is probe["bfloat16_faster"]
    assert patches["keras.trainer.multi_worker_symbolic_build"]["upstream"].startswith(
        "keras-team/keras#20585")
    assert all(patch["bug_present"] and patch["applied_by"] for patch in patches.values())


@pytest.mark.multiprocess
def test_env_reads_the_launcher_environment(tmp_path):
    tf_config = {"cluster": {"worker": ["localhost:1", "localhost:2"]},
                 "task": {"type": "worker", "index": 1}}
    result = run_command([TFDIST, "env", "--json"], cwd=tmp_path,
                         env={"TF_CONFIG": json.dumps(tf_config)})
    report = json.loads(result.stdout)
    assert report["cluster"]["tf_config"]["task_index"] == 1
    assert report["auto"]["strategy"] == "multi_worker"


@pytest.mark.multiprocess
def test_env_without_json_is_a_short_summary_for_a_person(tmp_path):
    tf_config = {"cluster": {"worker": ["localhost:1", "localhost:2"]},
                 "task": {"type": "worker", "index": 1}}
    result = run_command([TFDIST, "env"], cwd=tmp_path, env={"TF_CONFIG": json.dumps(tf_config)})
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert len(lines) <= 12
    assert lines[0].startswith(f"tfdist {tfdist.__version__} (from {REPO / 'tfdist'}), Python ")
    assert "TensorFlow 2.21" in lines[0]
    assert "cluster     TF_CONFIG: worker:1 of 2 tasks" in lines
    assert "auto        strategy multi_worker (TF_CONFIG names 2 workers)" in lines
    assert ("zero_stage  1, 2 and 3 under one_device, horovod (one_device: nothing to shard); "
            "refused by the others") in lines
    assert ("parallel    model_parallel.devices > 1 under one_device, horovod; refused by the "
            "others") in lines
    assert lines[-1] == "the full report, as JSON: tfdist env --json"


@pytest.mark.parametrize("args, status, fragment", [
    ([], 2, "usage: tfdist COMMAND"),
    (["--help"], 0, "usage: tfdist COMMAND"),
    (["--version"], 0, f"tfdist {tfdist.__version__}\n"),
    (["fly"], 2, "tfdist: error: unknown command 'fly'"),
    (["train", "extra"], 2, "takes flags only"),
])
@pytest.mark.multiprocess
def test_usage(args, status, fragment, tmp_path):
    result = run_command([TFDIST, *args], cwd=tmp_path)
    assert result.returncode == status
    assert fragment in result.stdout + result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.multiprocess
@pytest.mark.refuses
def test_a_command_line_with_several_mistakes_gets_a_line_for_each(tmp_path):
    result = run_command([TFDIST, "train", "--strategy", "mirorred", "--set", "train.epochz=2",
                          "--set", "accumulation_steps=0"], cwd=tmp_path)
    lines = result.stderr.splitlines()
    assert result.returncode == 2, result.stderr[-2000:]
    assert len(lines) == 3 and all(line.startswith("tfdist: error: ") for line in lines), lines
    assert "'mirorred'" in lines[0] and "train.epochz" in lines[1]
    assert "accumulation_steps must be" in lines[2]


@pytest.mark.multiprocess
def test_train_help_lists_tfdist_flags(tmp_path):
    result = run_command([TFDIST, "train", "--help"], cwd=tmp_path)
    assert result.returncode == 0
    for flag in ("--config", "--strategy", "--precision", "--accumulation_steps", "--set"):
        assert flag in result.stdout
    assert "mirrored.cpu_replicas (default: 0)" in result.stdout  # every key --set accepts


@pytest.mark.multiprocess
def test_example_script_trains_a_users_model_quietly(tmp_path):
    # BatchNormalization, Dropout, validation_data and evaluate, under 2 replicas; with no
    # TF_CPP_MIN_LOG_LEVEL set, as a user runs it: no TensorFlow or absl log line, as under
    # `tfdist train`, but the same summary line.
    result = run_command([sys.executable, str(REPO / "examples" / "keras_fit.py"),
                          "--strategy=mirrored", "--set", "mirrored.cpu_replicas=2",
                          "--epochs=2"], cwd=tmp_path, env={"TF_CPP_MIN_LOG_LEVEL": None})
    assert result.returncode == 0, result.stderr[-3000:]
    logged = [line for line in (result.stdout + result.stderr).splitlines()
              if is_tensorflow_log_line(line)]
    assert logged == []
    assert result.stderr.splitlines()[0] == ("tfdist: strategy mirrored (2 replicas; requested), "
                                             "precision float32 (the default)")
    summary = last_json_line(result.stdout)
    assert summary["replicas"] == 2
    assert summary["val_accuracy"] > 0.5  # 4 classes: better than chance
    assert summary["evaluate_accuracy"] > 0.5


@pytest.mark.multiprocess
@pytest.mark.parametrize("arguments, line", [
    (["--strategy=mirored"], "unknown strategy 'mirored'; did you mean 'mirrored'?"),
    (["--epochs=-1"], "--epochs must be >= 1. Received: --epochs=-1"),
    (["--set", "train.epochs=2"], "train.* keys set the job of `tfdist train`, which this "
                                  "script does not run; use its own --epochs and "
                                  "--global_batch_size"),
    (["--strategy=mirrored", "--set", "mirrored.cpu_replicas=2", "--global_batch_size=63"],
     "global_batch_size 63 does not divide across 2 replicas"),
], ids=["strategy", "epochs", "train_keys", "batch"])
@pytest.mark.refuses
def test_example_script_reports_bad_input_in_one_line_with_status_2(arguments, line, tmp_path):
    result = run_command([sys.executable, str(REPO / "examples" / "keras_fit.py"), *arguments],
                         cwd=tmp_path)
    said = [text for text in result.stderr.splitlines()
            if text.strip() and not is_tensorflow_log_line(text)
            and not text.startswith("tfdist: strategy")]  # the chief's summary line
    assert result.returncode == 2, result.stderr[-2000:]
    assert len(said) == 1 and said[0].startswith("keras_fit.py: error: ") and line in said[0], \
        said


def test_a_lost_cluster_is_one_line_with_status_1(capsys):
    from tfdist.app import cli
    from tfdist.errors import ClusterError

    def lose_a_server():
        raise ClusterError("parameter server ps:0 (127.0.0.1:1) stopped answering")

    with pytest.raises(SystemExit) as exit_info:
        cli._one_line_errors(lose_a_server)(["tfdist train"])
    assert exit_info.value.code == 1
    assert capsys.readouterr().err == ("tfdist: error: parameter server ps:0 (127.0.0.1:1) "
                                       "stopped answering\n")


@pytest.mark.multiprocess
def test_train_with_a_checkpoint_dir_resumes_and_a_finished_run_trains_no_step(tmp_path):
    command = [TFDIST, "train", "--strategy", "one_device", "--checkpoint_dir", "ckpt",
               "--set", "train.epochs=2", "--set", "seed=3"]
    first = run_command(command, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    assert sorted(path.name for path in (tmp_path / "ckpt").glob("*.index")) == [
        "ckpt-22.index", "ckpt-44.index"]  # the end of each epoch (22 steps of 64)
    again = run_command(command, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming from ckpt/ckpt-44: the end of epoch 2 (step 44 in all)" in again.stderr
    before, after = last_json_line(first.stdout), last_json_line(again.stdout)
    assert (before["epochs_trained"], after["epochs_trained"]) == (2, 0)
    assert after["final_loss"] is None and after["checkpoint_dir"] == "ckpt"
    assert after["accuracy"] == before["accuracy"]  # the restored weights, evaluated
    assert "finished all 2 epochs: nothing to train" in again.stderr
    # Another run in the same folder (fewer epochs, another rate) is refused in one line.
    other = run_command([*command, "--set", "train.epochs=1", "--set",
                         "train.learning_rate=1e-2"], cwd=tmp_path)
    assert other.returncode == 2
    assert "Traceback" not in other.stderr and other.stderr.strip().splitlines()[-1:] == [
        "tfdist: error: checkpoint folder ckpt holds another run: epochs: 2 -> 1 (fewer); "
        "optimizer.learning_rate: 0.001 -> 0.01. Start fresh with another checkpoint folder "
        "(or delete this one), or resume it anyway with checkpoint.resume_changed=true. "
        "Received: checkpoint_dir='ckpt'"]


@pytest.mark.parametrize("error, words", [
    ("DeadlineExceededError", "a peer did not join a collective within its timeout"),
    ("UnknownError", "Horovod shut down: a rank stopped joining collectives")])
def test_a_lost_or_stuck_peer_is_one_line(error, words):
    import tensorflow as tf

    from tfdist.app.cli import _peer_failure

    message = {"DeadlineExceededError": "Collective has timed out during execution.",
               "UnknownError": "Horovod has been shut down. This was caused by an exception"}
    failure = getattr(tf.errors, error)(None, None, message[error])
    line = _peer_failure(failure)
    assert words in line and "\n" not in line
    assert _peer_failure(tf.errors.UnknownError(None, None, "something else")) is None
