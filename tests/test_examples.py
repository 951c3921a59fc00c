"""The cluster examples say what tfdist reads: a TFJob's workers, a Slurm step's tasks."""

import json

import yaml

import tfdist
from tfdist.cluster import detect_cluster
from tests.conftest import REPO


def test_tfjob_runs_tfdist_train_on_two_workers():
    job = yaml.safe_load((REPO / "examples" / "k8s" / "tfjob.yaml").read_text())
    assert job["kind"] == "TFJob"
    worker = job["spec"]["tfReplicaSpecs"]["Worker"]
    assert worker["replicas"] == 2
    container = worker["template"]["spec"]["containers"][0]
    assert container["name"] == "tensorflow"
    assert container["command"] == ["tfdist", "train"]
    assert "--strategy=multi_worker" in container["args"]
    # The flags parse into a valid config.
    overrides = dict(arg.removeprefix("--set=").split("=", 1) for arg in container["args"]
                     if arg.startswith("--set="))
    config = tfdist.load_config(overrides={k: yaml.safe_load(v) for k, v in overrides.items()})
    assert config.multi_worker.timeout_seconds == 300


def test_tf_config_as_the_training_operator_sets_it_makes_auto_choose_multi_worker():
    # The operator's documented TF_CONFIG for worker 1 of this job.
    tf_config = {"cluster": {"worker": ["tfdist-digits-worker-0.default.svc:2222",
                                        "tfdist-digits-worker-1.default.svc:2222"]},
                 "task": {"type": "worker", "index": 1}, "environment": "cloud"}
    info = detect_cluster({"TF_CONFIG": json.dumps(tf_config)}, probe_gpus=False)
    from tfdist.runner import choose_strategy

    assert choose_strategy(info)[0] is tfdist.Strategy.MULTI_WORKER
    assert info.tf_config.task_index == 1 and not info.tf_config.is_chief


def test_sbatch_runs_one_task_per_worker_under_srun():
    script = (REPO / "examples" / "slurm" / "train.sbatch").read_text()
    assert "#SBATCH --ntasks-per-node=2" in script
    assert "srun tfdist train" in script
    assert "--strategy=multi_worker" in script
