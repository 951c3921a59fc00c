"""Bad input: one clear line naming the problem and the fix; never a traceback.

Each case runs twice: through Python (a `tfdist.ConfigError`, which is a
`ValueError`) and through the CLI (exit status 2, one `tfdist: error:` line).
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from typing import Callable

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tfdist.adapters.parameter_server import coordinated_fit
from tfdist.app import launch, train
from tfdist.cluster import detect_cluster
from tfdist.devices import model_devices
from tfdist.files import writable_folder
from tfdist.parallel import Pipeline
from tfdist.resume.backup import BackupAndRestore
from tfdist.sharding import sharded_optimizer
from tests.conftest import TFDIST, run_command

TWO_REPLICAS = {"strategy": "mirrored", "mirrored.cpu_replicas": 2}
TWO_REPLICA_FLAGS = ["--strategy=mirrored", "--set", "mirrored.cpu_replicas=2"]
TWO_CHIEFS = json.dumps({"cluster": {"chief": ["localhost:1", "localhost:2"]},
                         "task": {"type": "chief", "index": 0}})
WITH_PS = json.dumps({"cluster": {"chief": ["localhost:1"], "worker": ["localhost:2"],
                                  "ps": ["localhost:3"]}, "task": {"type": "worker", "index": 0}})
AN_EVALUATOR = json.dumps({"cluster": {"worker": ["localhost:1"], "evaluator": ["localhost:2"]},
                           "task": {"type": "evaluator", "index": 0}})
A_NEGATIVE_INDEX = json.dumps({"cluster": {"worker": ["localhost:1"]},
                               "task": {"type": "worker", "index": -1}})


def runner(overrides, env=None):
    cluster = detect_cluster(env, probe_gpus=False) if env is not None else None
    return tfdist.Runner(tfdist.load_config(overrides=overrides), cluster=cluster)


def fit_under_parameter_server(**arguments):
    """tfdist's model.fit under parameter_server (what the strategy's fit runs): its
    arguments are checked before any task is reached, so no cluster is needed here."""
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
    batches = tf.data.Dataset.from_tensor_slices((tf.ones((32, 4)), tf.ones((32, 2)))).batch(8)
    coordinated_fit.fit(model, model.fit, **{"x": batches, **arguments})


def train_without_tensorboard(directory):
    # None in sys.modules is how Python marks a module that cannot be imported.
    saved = sys.modules.get("tensorboard")
    sys.modules["tensorboard"] = None
    try:
        train.run(tfdist.load_config(overrides={"strategy": "one_device",
                                                "train.tensorboard": True,
                                                "train.output_dir": str(directory)}))
    finally:
        if saved is None:
            del sys.modules["tensorboard"]
        else:
            sys.modules["tensorboard"] = saved


def fit_model_made_outside_the_scope(directory):
    run = runner(TWO_REPLICAS)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])  # outside
    with run.scope():
        model.compile(optimizer=run.optimizer(keras.optimizers.SGD(0.1)), loss="mse")
    examples = tf.data.Dataset.from_tensor_slices((tf.ones((32, 4)), tf.ones((32, 2))))
    model.fit(run.dataset(examples, 16), epochs=1, verbose=0, callbacks=run.callbacks())


@dataclasses.dataclass
class Case:
    name: str
    cli: list[str] | None               # flags after `tfdist train`; None: Python only
    python: Callable | None             # called with tmp_path; must raise ConfigError
    expect: str                         # a fragment of the one-line message
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    files: dict[str, str] = dataclasses.field(default_factory=dict)


CASES = [
    Case("unknown strategy", ["--strategy=mirored"],
         lambda d: tfdist.load_config(overrides={"strategy": "mirored"}),
         "unknown strategy 'mirored'; did you mean 'mirrored'?"),
    Case("unknown precision", ["--precision=fp8"],
         lambda d: tfdist.load_config(overrides={"precision": "fp8"}), "unknown precision 'fp8'"),
    Case("unknown top-level key", ["--set", "epochs=3"],
         lambda d: tfdist.load_config(overrides={"epochs": 3}), "did you mean 'train.epochs'?"),
    Case("unknown nested key", ["--set", "mirrored.cpu_replica=2"],
         lambda d: tfdist.load_config(overrides={"mirrored.cpu_replica": 2}),
         "did you mean 'mirrored.cpu_replicas'?"),
    Case("wrong type", ["--set", "train.epochs=three"],
         lambda d: tfdist.load_config(overrides={"train.epochs": "three"}),
         "train.epochs must be an integer. Received: train.epochs='three'"),
    Case("accumulation_steps 0", ["--accumulation_steps=0"],
         lambda d: tfdist.load_config(overrides={"accumulation_steps": 0}),
         "accumulation_steps must be an integer >= 1"),
    Case("negative cpu_replicas", ["--set", "mirrored.cpu_replicas=-2"],
         lambda d: tfdist.load_config(overrides={"mirrored.cpu_replicas": -2}),
         "mirrored.cpu_replicas must be an integer >= 0"),
    Case("global batch of 0", ["--set", "train.global_batch_size=0"],
         lambda d: tfdist.load_config(overrides={"train.global_batch_size": 0}),
         "train.global_batch_size must be an integer >= 1"),
    Case("malformed YAML", ["--config=bad.yaml"],
         lambda d: tfdist.load_config(d / "bad.yaml"),
         "is not valid YAML at line 2",
         files={"bad.yaml": "strategy: mirrored\n  precision: [x\n"}),
    Case("YAML reads off as false", ["--config=off.yaml"],
         lambda d: tfdist.load_config(d / "off.yaml"), "quote the value",
         files={"off.yaml": "strategy: off\n"}),
    Case("missing config file", ["--config=nope.yaml"],
         lambda d: tfdist.load_config(d / "nope.yaml"), "config file not found"),
    Case("config is not a mapping", ["--config=list.yaml"],
         lambda d: tfdist.load_config(d / "list.yaml"), "must hold a mapping",
         files={"list.yaml": "- strategy\n- mirrored\n"}),
    Case("devices and cpu_replicas together",
         ["--set", "mirrored.cpu_replicas=2", "--set", "mirrored.devices=[/cpu:0]"],
         lambda d: tfdist.load_config(overrides={"mirrored.cpu_replicas": 2,
                                                 "mirrored.devices": ["/cpu:0"]}), "not both"),
    Case("mixed_float16 on TPU", ["--strategy=tpu", "--precision=mixed_float16"],
         lambda d: tfdist.load_config(overrides={"strategy": "tpu", "precision": "fp16"}),
         "mixed_float16 does not run on TPU"),
    Case("parameter_server without a cluster", ["--strategy=parameter_server"],
         lambda d: runner({"strategy": "parameter_server"}),
         "strategy parameter_server found no cluster: set TF_CONFIG"),
    Case("malformed TF_CONFIG", ["--strategy=one_device"],
         lambda d: runner({"strategy": "one_device"}, env={"TF_CONFIG": '{"cluster": '}),
         "TF_CONFIG is not valid JSON", env={"TF_CONFIG": '{"cluster": '}),
    Case("TF_CONFIG task index out of range", ["--strategy=one_device"],
         lambda d: runner({"strategy": "one_device"}, env={"TF_CONFIG": json.dumps(
             {"cluster": {"worker": ["localhost:1"]}, "task": {"type": "worker", "index": 3}})}),
         "task.index 3 is out of range",
         env={"TF_CONFIG": json.dumps({"cluster": {"worker": ["localhost:1"]},
                                       "task": {"type": "worker", "index": 3}})}),
    Case("two chiefs in TF_CONFIG", ["--strategy=multi_worker"],
         lambda d: runner({"strategy": "multi_worker"}, env={"TF_CONFIG": TWO_CHIEFS}),
         "more than one chief", env={"TF_CONFIG": TWO_CHIEFS}),
    Case("multi_worker with no cluster", ["--strategy=multi_worker"],
         lambda d: runner({"strategy": "multi_worker"}, env={}), "found no cluster"),
    Case("multi_worker task index beyond its workers",
         ["--set", "multi_worker.workers=[localhost:1, localhost:2]",
          "--set", "multi_worker.task_index=2"],
         lambda d: tfdist.load_config(overrides={
             "multi_worker.workers": ["localhost:1", "localhost:2"],
             "multi_worker.task_index": 2}),
         "multi_worker.task_index must be an index into multi_worker.workers (0 to 1)"),
    Case("TPU requested with no TPU", ["--strategy=tpu"],
         lambda d: runner({"strategy": "tpu"}), "found no TPU"),
    Case("NCCL without GPUs", [*TWO_REPLICA_FLAGS[:1], "--set", "mirrored.cross_device_ops=nccl"],
         lambda d: runner({"strategy": "mirrored", "mirrored.cross_device_ops": "nccl"}),
         "nccl needs GPUs"),
    Case("a GPU that is not there", ["--strategy=one_device", "--set", "one_device.device=/gpu:3"],
         lambda d: runner({"strategy": "one_device", "one_device.device": "/gpu:3"}),
         "names /gpu:3, but this machine has 0 GPU(s)"),
    Case("batch does not divide across replicas",
         [*TWO_REPLICA_FLAGS, "--set", "train.global_batch_size=63"],
         lambda d: runner(TWO_REPLICAS).dataset(tf.data.Dataset.range(100), 63),
         "global_batch_size 63 does not divide across 2 replicas; use a multiple of 2"),
    Case("a learning rate that is not finite", ["--set", "train.learning_rate=.inf"],
         lambda d: tfdist.load_config(overrides={"train.learning_rate": float("inf")}),
         "train.learning_rate must be a finite number"),
    Case("a global batch larger than the data", ["--set", "train.global_batch_size=100000"],
         lambda d: runner({"strategy": "one_device"}).dataset(tf.data.Dataset.range(100), 1000),
         "fewer than one global batch of"),
    Case("a dataset batched already (Python only)", None,
         lambda d: runner({"strategy": "one_device"}).dataset(
             tf.data.Dataset.range(100).batch(10).prefetch(2), 10),
         "this dataset is batched already (its .batch())"),
    Case("an output folder that cannot be written", ["--set", "train.output_dir=/proc/nope"],
         lambda d: writable_folder("/proc/nope", "train.output_dir"),
         "train.output_dir /proc/nope is not a folder this process can write in"),
    Case("a checkpoint folder that cannot be written", ["--checkpoint_dir=/proc/nope"],
         lambda d: runner({"strategy": "one_device"}).callbacks(checkpoint_dir="/proc/nope"),
         "checkpoint_dir /proc/nope is not a folder this process can write in"),
    Case("a model made outside runner.scope() (Python only)", None,
         fit_model_made_outside_the_scope, "the model was created outside runner.scope()"),
    Case("zero_stage 4", ["--zero_stage=4"],
         lambda d: tfdist.load_config(overrides={"zero_stage": 4}),
         "zero_stage must be 0, 1, 2 or 3"),
    Case("zero_stage under mirrored", ["--strategy=mirrored", "--zero_stage=1"],
         lambda d: runner({"strategy": "mirrored", "zero_stage": 1}),
         "zero_stage 1 cannot run under strategy mirrored: Keras's optimizer under "
         "tf.distribute creates each slot as one mirrored variable"),
    Case("zero_stage under parameter_server", ["--strategy=parameter_server", "--zero_stage=2"],
         lambda d: runner({"strategy": "parameter_server", "zero_stage": 2}),
         "zero_stage 2 cannot run under strategy parameter_server: its variables and their "
         "optimizer state live on the parameter servers already"),
    Case("zero_stage 2 with an optimizer that is not element-wise (Python only)", None,
         lambda d: sharded_optimizer(keras.optimizers.Lamb(0.01), None, stage=2),
         "Lamb is not one of them: use zero_stage 1"),
    Case("model_parallel under mirrored", ["--strategy=mirrored",
                                           "--set", "model_parallel.devices=2"],
         lambda d: runner({"strategy": "mirrored", "model_parallel.devices": 2}),
         "model_parallel.devices 2 cannot run under strategy mirrored: each of its replicas is "
         "one device"),
    Case("micro-batches that do not divide the batch", [
            "--strategy=one_device", "--set", "model_parallel.devices=2",
            "--set", "model_parallel.micro_batches=3"],
         lambda d: runner({"strategy": "one_device", "model_parallel.devices": 2,
                           "model_parallel.micro_batches": 3}).dataset(
             tf.data.Dataset.range(512), 64),
         "model_parallel.micro_batches=3 must divide each replica's batch of 64 examples"),
    Case("a string given a number", ["--set", "strategy=3"],
         lambda d: tfdist.load_config(overrides={"strategy": 3}),
         "strategy must be a string, one of auto, one_device"),
    Case("a numbered choice given a word", ["--set", "zero_stage=two"],
         lambda d: tfdist.load_config(overrides={"zero_stage": "two"}),
         "zero_stage must be an integer. Received: zero_stage='two' (str)"),
    Case("a text setting given a YAML boolean", ["--set", "train.output_dir=off"],
         lambda d: tfdist.load_config(overrides={"train.output_dir": False}),
         "train.output_dir must be a string; YAML reads unquoted yes/no/on/off"),
    Case("a config path that is a folder", ["--config=."],
         lambda d: tfdist.load_config(d), "config path is a directory"),
    Case("an empty override key (Python only)", None,
         lambda d: tfdist.load_config(overrides={"": 1}), "override keys must be non-empty"),
    Case("an override inside a value (Python only)", None,
         lambda d: tfdist.load_config(overrides={"strategy": "mirrored", "strategy.x": 1}),
         "override 'strategy.x' reaches inside 'strategy', which is not a section"),
    Case("a flag's value and a key inside it", ["--strategy=mirrored", "--set", "strategy.x=1"],
         lambda d: tfdist.load_config(overrides={"strategy.x": 1, "strategy": "mirrored"}),
         "override 'strategy' is a section, which strategy.x set keys inside, and a value too"),
    Case("--set with a value that is not YAML (CLI only)", ["--set", "train.epochs=[1"], None,
         "--set train.epochs= has a value that is not valid YAML; quote it"),
    Case("a device that is not a device", ["--set", "one_device.device=/cpu:zero"],
         lambda d: runner({"strategy": "one_device", "one_device.device": "/cpu:zero"}),
         "one_device.device must be a device such as '/cpu:0'"),
    Case("a device that is neither CPU nor GPU", ["--set", "one_device.device=/tpu:0"],
         lambda d: runner({"strategy": "one_device", "one_device.device": "/tpu:0"}),
         "one_device.device must name a CPU or GPU device"),
    Case("multi_worker in a cluster with ps tasks", ["--strategy=multi_worker"],
         lambda d: runner({"strategy": "multi_worker"}, env={"TF_CONFIG": WITH_PS}),
         "strategy multi_worker trains on chief and worker tasks only, and TF_CONFIG names "
         "1 ps tasks", env={"TF_CONFIG": WITH_PS}),
    Case("multi_worker as an evaluator", ["--strategy=multi_worker"],
         lambda d: runner({"strategy": "multi_worker"}, env={"TF_CONFIG": AN_EVALUATOR}),
         "TF_CONFIG makes this process a 'evaluator'", env={"TF_CONFIG": AN_EVALUATOR}),
    Case("a negative TF_CONFIG task index", ["--strategy=one_device"],
         lambda d: runner({"strategy": "one_device"}, env={"TF_CONFIG": A_NEGATIVE_INDEX}),
         "TF_CONFIG task.index must be an integer >= 0", env={"TF_CONFIG": A_NEGATIVE_INDEX}),
    Case("a launcher's rank without its size", ["--strategy=one_device"],
         lambda d: runner({"strategy": "one_device"}, env={"OMPI_COMM_WORLD_RANK": "0"}),
         "OMPI_COMM_WORLD_SIZE is not set, though its launcher's other variables are",
         env={"OMPI_COMM_WORLD_RANK": "0"}),
    Case("zero_stage 3 with model_parallel", ["--strategy=horovod", "--zero_stage=3",
                                              "--set", "model_parallel.devices=2"], None,
         "zero_stage 3 stores each weight as 1/N per rank, and model_parallel places whole "
         "layers on devices"),
    Case("TensorBoard logs without tensorboard (Python only)", None,
         train_without_tensorboard, "train.tensorboard needs the tensorboard package"),
    Case("run_elastic outside Horovod (Python only)", None,
         lambda d: runner({"strategy": "one_device"}).run_elastic(lambda state: None),
         "runner.run_elastic needs strategy horovod"),
    Case("a global batch of 0 for runner.dataset (Python only)", None,
         lambda d: runner({"strategy": "one_device"}).dataset(tf.data.Dataset.range(100), 0),
         "global_batch_size must be an integer >= 1. Received: global_batch_size=0"),
    Case("a negative shuffle buffer (Python only)", None,
         lambda d: runner({"strategy": "one_device"}).dataset(tf.data.Dataset.range(100), 10,
                                                              shuffle_buffer_size=-1),
         "shuffle_buffer_size must be an integer >= 0"),
    Case("a Runner given a strategy's name (Python only)", None,
         lambda d: tfdist.Runner("mirrored"), "Runner needs a tfdist.Config"),
    Case("checkpoints kept: 1 (Python only)", None,
         lambda d: runner({"strategy": "one_device"}).callbacks(checkpoint_dir=d, keep=1),
         "keep must be an integer >= 2. Received: keep=1"),
    Case("a checkpoint folder that is empty text (Python only)", None,
         lambda d: BackupAndRestore("", runner({"strategy": "one_device"})._adapter),
         "checkpoint_dir must name a folder"),
    Case("tfdist launch on a network that is neither (Python only)", None,
         lambda d: launch.launch(["true"], 1, network="public"),
         "tfdist launch --network must be private or host"),
    Case("a Pipeline of no layers (Python only)", None,
         lambda d: Pipeline([]), "Pipeline needs at least one layer"),
    Case("a Pipeline of -1 micro-batches (Python only)", None,
         lambda d: Pipeline([keras.layers.Dense(2)], micro_batches=-1, devices=["/cpu:0"]),
         "Pipeline micro_batches must be an integer >= 1"),
    Case("zero_stage over variables of two dtypes (Python only)", None,
         lambda d: sharded_optimizer(keras.optimizers.SGD(0.1), None, stage=1).build(
             [keras.Variable(np.zeros(2, "float32")), keras.Variable(np.zeros(2, "float64"))]),
         "zero_stage 1 shards variables of one dtype, but this model trains float32, float64"),
    Case("zero_stage with Keras's own accumulation (Python only)", None,
         lambda d: sharded_optimizer(keras.optimizers.SGD(0.1, gradient_accumulation_steps=2),
                                     None, stage=1),
         "zero_stage 1 cannot shard Keras's own gradient_accumulation_steps"),
    Case("no free port for a task (Python only)", None,
         # 192.0.2.1 (TEST-NET-1) is on no interface of this machine: no port binds there.
         lambda d: launch.free_ports(1, host="192.0.2.1"),
         "tfdist launch found 0 of 1 free ports on 192.0.2.1"),
    Case("more model devices than GPUs (Python only)", None,
         lambda d: model_devices(2, gpus=1),
         "model_parallel.devices=2 needs 2 GPUs for each process, but it sees 1"),
    Case("class_weight to fit under parameter_server (Python only)", None,
         lambda d: fit_under_parameter_server(class_weight={0: 1.0}),
         "model.fit under parameter_server does not take class_weight"),
    Case("no data to fit under parameter_server (Python only)", None,
         lambda d: fit_under_parameter_server(x=None),
         "model.fit under parameter_server needs a batched tf.data.Dataset"),
    Case("0 steps per epoch under parameter_server (Python only)", None,
         lambda d: fit_under_parameter_server(steps_per_epoch=0),
         "steps_per_epoch must be an integer >= 1. Received: steps_per_epoch=0"),
    Case("an endless dataset without steps under parameter_server (Python only)", None,
         lambda d: fit_under_parameter_server(
             x=tf.data.Dataset.from_tensor_slices((tf.ones((8, 4)), tf.ones((8, 2)))).batch(
                 4).repeat()),
         "model.fit under parameter_server needs steps_per_epoch for a dataset that is "
         "infinite"),
    Case("malformed --set (CLI only)", ["--set", "epochs"], None, "--set expects KEY=VALUE"),
    Case("unknown flag (CLI only)", ["--strategyy=mirrored"], None,
         "Unknown command line flag 'strategyy'"),
]


def _write_files(case, directory):
    for name, text in case.files.items():
        (directory / name).write_text(text)


def test_the_table_has_at_least_15_cases():
    assert len([c for c in CASES if c.python is not None]) >= 15


@pytest.mark.parametrize("case", [c for c in CASES if c.python], ids=lambda c: c.name)
def test_python_raises_one_line_config_error(case, tmp_path):
    _write_files(case, tmp_path)
    with pytest.raises(tfdist.ConfigError) as raised:
        case.python(tmp_path)
    message = str(raised.value)
    assert isinstance(raised.value, ValueError)
    assert case.expect in message
    assert "\n" not in message
    assert "Received" in message or "found no TPU" in message or "YAML" in message


@pytest.mark.parametrize("case", [c for c in CASES if c.cli is not None], ids=lambda c: c.name)
@pytest.mark.multiprocess
@pytest.mark.refuses
def test_cli_exits_2_with_one_error_line(case, tmp_path):
    _write_files(case, tmp_path)
    # A short run, should a case not fail; the case's own flags come last and win.
    result = run_command([TFDIST, "train", "--set", "train.epochs=1", *case.cli],
                         cwd=tmp_path, env=case.env)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("tfdist: error:")]
    assert len(errors) == 1, result.stderr[-2000:]
    assert case.expect in errors[0]
    assert result.stderr.rstrip().splitlines()[-1] == errors[0]  # the last word is ours
    assert result.stdout.strip() == "" or not re.search(r"^\{", result.stdout, re.M)
