"""The cluster examples and the images: what tfdist reads from them (a TFJob's workers, a
Slurm step's tasks), what a restart needs, and tfdist command lines that are valid.

Nothing here runs Kubernetes, Slurm or a container builder (none is on the test machine;
the README says so). What can be checked without them is: the fields a resumable job
needs, that every `tfdist train` command line in them parses into a config, and that
the images install what `scripts/setup.sh` installs.
"""

import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml
from absl import flags
from absl.testing import flagsaver

import tfdist
from tfdist import flags as tfdist_flags
from tfdist.cluster import detect_cluster
from tfdist.config import Strategy
from tfdist.resume.preemption import RESTART_EXIT_CODE
from tests.conftest import REPO

FLAGS = flags.FLAGS
EXAMPLES = REPO / "examples"
IMAGE_USER_ID = 1000


def documents(path):
    return {document["kind"]: document for document in yaml.safe_load_all(path.read_text())}


@flagsaver.flagsaver
def config_of(args):
    """The config `tfdist train ARGS` would run with (a bad flag or value raises)."""
    FLAGS.unparse_flags()
    FLAGS(["tfdist train", *args])
    return tfdist_flags.config_from_flags()


def mounted_under(path, mounts):
    return any(Path(path).is_relative_to(mount["mountPath"]) for mount in mounts)


def test_the_tfjob_restarts_preemptions_only_and_resumes_from_a_shared_volume():
    found = documents(EXAMPLES / "k8s" / "tfjob.yaml")
    claim, job = found["PersistentVolumeClaim"], found["TFJob"]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    worker = job["spec"]["tfReplicaSpecs"]["Worker"]
    # Kubeflow's ExitCode policy restarts 128-255 (143: preempted, saved) and fails 1-127.
    assert worker["restartPolicy"] == "ExitCode" and 128 <= RESTART_EXIT_CODE <= 255
    pod = worker["template"]["spec"]
    assert pod["securityContext"]["fsGroup"] == IMAGE_USER_ID
    [container] = pod["containers"]
    assert container["name"] == "tensorflow"  # the name the operator looks for
    assert container["command"] == ["tfdist", "train"]
    config = config_of(container["args"])
    assert config.strategy is Strategy.MULTI_WORKER
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    shared = [mount for mount in container["volumeMounts"]
              if volumes[mount["name"]].get("persistentVolumeClaim", {}).get("claimName")
              == claim["metadata"]["name"]]
    assert mounted_under(config.checkpoint.dir, shared)
    assert mounted_under(config.train.output_dir, shared)
    assert config.checkpoint.grace_seconds < pod["terminationGracePeriodSeconds"]


def test_the_horovod_job_runs_mpirun_under_tfdist_supervise_and_keys_its_policy_on_143():
    found = documents(EXAMPLES / "k8s" / "horovod-job.yaml")
    claim, job = found["PersistentVolumeClaim"], found["Job"]
    pod = job["spec"]["template"]["spec"]
    [container] = pod["containers"]
    command = container["command"]
    assert command[:2] == ["tfdist", "supervise"] and "mpirun" in command
    supervise_grace = float(next(arg.split("=", 1)[1] for arg in command
                                 if arg.startswith("--grace_seconds=")))
    assert command[-2:] == ["tfdist", "train"]
    config = config_of(container["args"])
    assert config.strategy is Strategy.HOROVOD
    # The ranks save within their grace, inside the supervisor's, inside the kubelet's.
    assert (config.checkpoint.grace_seconds < supervise_grace
            < pod["terminationGracePeriodSeconds"])
    rules = {rule["action"]: rule["onExitCodes"] for rule in job["spec"]["podFailurePolicy"]
             ["rules"] if "onExitCodes" in rule}
    assert rules["Ignore"]["values"] == [RESTART_EXIT_CODE]
    assert rules["FailJob"]["values"] == [2]  # a config error is not retried
    assert {rule["containerName"] for rule in rules.values()} == {container["name"]}
    assert pod["restartPolicy"] == "Never"  # what podFailurePolicy requires
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    shared = [mount for mount in container["volumeMounts"]
              if volumes[mount["name"]]["persistentVolumeClaim"]["claimName"]
              == claim["metadata"]["name"]]
    assert mounted_under(config.checkpoint.dir, shared)


def test_tf_config_as_the_training_operator_sets_it_makes_auto_choose_multi_worker():
    # The operator's documented TF_CONFIG for worker 1 of this job.
    tf_config = {"cluster": {"worker": ["tfdist-digits-worker-0.default.svc:2222",
                                        "tfdist-digits-worker-1.default.svc:2222"]},
                 "task": {"type": "worker", "index": 1}, "environment": "cloud"}
    info = detect_cluster({"TF_CONFIG": json.dumps(tf_config)}, probe_gpus=False)
    from tfdist.runner import choose_strategy

    assert choose_strategy(info)[0] is tfdist.Strategy.MULTI_WORKER
    assert info.tf_config.task_index == 1 and not info.tf_config.is_chief


def sbatch_training_args(text):
    """The arguments of the script's `srun tfdist train` (continuation lines joined)."""
    joined = text.replace("\\\n", " ")
    [line] = [line for line in joined.splitlines() if line.lstrip().startswith("srun tfdist")]
    return shlex.split(line.split("tfdist train", 1)[1])


def test_the_sbatch_script_signals_saves_and_requeues_on_143():
    path = EXAMPLES / "slurm" / "train.sbatch"
    text = path.read_text()
    subprocess.run(["bash", "-n", str(path)], check=True)  # it parses as bash
    directives = re.findall(r"^#SBATCH (\S+)", text, flags=re.MULTILINE)
    assert "--ntasks-per-node=2" in directives  # one task per worker, under srun
    assert "--requeue" in directives and "--open-mode=append" in directives
    [signal] = [d for d in directives if d.startswith("--signal=")]
    signal_name, seconds = signal.removeprefix("--signal=").split("@")
    assert signal_name == "TERM"  # to every task: tfdist's preemption signal
    config = config_of(sbatch_training_args(text))
    assert config.strategy is Strategy.MULTI_WORKER
    assert config.checkpoint.dir.startswith("$RUN_DIR/")
    assert config.checkpoint.grace_seconds < int(seconds)
    assert f'"$status" -eq {RESTART_EXIT_CODE} ]' in text and 'scontrol requeue' in text


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.gpu"])
def test_the_images_install_what_setup_installs(name):
    text = (REPO / "docker" / name).read_text()
    instructions = re.findall(r"^([A-Z]+) (.*)$", text, flags=re.MULTILINE)
    copied = [source for kind, args in instructions if kind == "COPY"
              for source in args.split()[:-1]]
    for source in copied:
        assert (REPO / source).exists(), source
    ignored = (REPO / ".dockerignore").read_text().split()
    assert not set(copied) & set(ignored)
    assert "openmpi-bin" in text and "libopenmpi-dev" in text  # mpirun, and Horovod's build
    assert 'HOROVOD_PYTHON="$VIRTUAL_ENV/bin/python" scripts/install_horovod.sh' in text
    assert f"useradd --create-home --uid {IMAGE_USER_ID}" in text and "USER tfdist" in text
    [base] = [args for kind, args in instructions if kind == "FROM"]
    pyproject = (REPO / "pyproject.toml").read_text()
    if name == "Dockerfile":
        assert 'pip install --no-cache-dir ".[cpu]"' in text
        python = re.search(r"requires-python = \">=3\.(\d+)\"", pyproject).group(1)
        assert int(re.fullmatch(r"python:3\.(\d+)-slim-\w+", base).group(1)) >= int(python)
    else:
        # TensorFlow's own GPU image, of the release pyproject.toml pins.
        pinned = re.search(r'"tensorflow-cpu>=(\d+\.\d+),', pyproject).group(1)
        assert base == f"tensorflow/tensorflow:{pinned}.0-gpu"
