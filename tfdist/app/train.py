"""The main job: the reference model trained with the user's path, `model.fit` under a Runner.

`tfdist train` runs `run(config)` and prints its result as one JSON line.

Example:

    result = run(load_config("mirrored", overrides={"train.epochs": 2}))
    result["accuracy"], result["examples_per_sec"]
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import sys
from typing import Any

import keras

from tfdist.app import data
from tfdist.callbacks import Throughput
from tfdist.config import Config, OptimizerName, TrainConfig
from tfdist.errors import ConfigError
from tfdist.files import atomic_write_text, writable_folder
from tfdist.memory import PeakMemory
from tfdist.parallel import Pipeline
from tfdist.runner import Runner
from tfdist.sharding import state_bytes


def build_reference_model(num_features: int, num_classes: int, hidden_units: int = 128,
                          hidden_layers: int = 2) -> keras.Model:
    """A multilayer perceptron classifier; its output softmax computes in float32.

    Under mixed precision the logits are float16/bfloat16; the softmax and so the
    loss stay float32, as the Keras mixed-precision guide recommends.

    Args:
        num_features: Input width.
        num_classes: Output classes.
        hidden_units: Width of each hidden layer.
        hidden_layers: Number of hidden layers.
    """
    inputs = keras.Input((num_features,), name="features")
    outputs = inputs
    for layer in reference_layers(num_classes, hidden_units, hidden_layers):
        outputs = layer(outputs)
    return keras.Model(inputs, outputs, name="reference_mlp")


def reference_layers(num_classes: int, hidden_units: int = 128,
                     hidden_layers: int = 2) -> list[keras.layers.Layer]:
    """The reference model's layers in order (a `tfdist.parallel.Pipeline` takes them)."""
    return [*[keras.layers.Dense(hidden_units, activation="relu", name=f"hidden_{index}")
              for index in range(hidden_layers)],
            keras.layers.Dense(num_classes, name="logits"),
            keras.layers.Activation("softmax", dtype="float32", name="probabilities")]


def make_optimizer(train: TrainConfig) -> keras.optimizers.Optimizer:
    """The optimizer the main job's config names."""
    if train.optimizer is OptimizerName.SGD:
        return keras.optimizers.SGD(train.learning_rate)
    return keras.optimizers.Adam(train.learning_rate)


def run(config: Config, *, runner: Runner | None = None) -> dict[str, Any]:
    """Trains and evaluates the reference model; the chief writes config.yaml and result.json.

    Args:
        config: The run's config; `config.train` sets the job.
        runner: A Runner built from `config` already. None: build one.

    Returns:
        The result: strategy, replicas, precision, accumulation_steps,
        global_batch_size (per forward pass) and effective_batch_size (per update), epochs,
        final_loss (training loss of the last epoch), accuracy (on the held-out
        split), examples_per_sec (median over epochs after the first), and more.
    """
    runner = Runner(config) if runner is None else runner
    job = runner.config.train
    if job.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("train.tensorboard needs the tensorboard package; pip install "
                          "tensorboard, or set train.tensorboard=false. "
                          "Received: train.tensorboard=true")
    if runner.is_chief:
        # Before training, not after it: the result is written there at the end.
        writable_folder(job.output_dir, "train.output_dir")
    splits = data.load(job)
    # Shuffled by the Runner: the same order on every worker (each takes its slices, so
    # together they see every example once per epoch), fixed by (seed, epoch), so a run
    # resumed from a checkpoint sees the batches it would have seen.
    train_data = runner.dataset(splits.train, job.global_batch_size,
                                shuffle_buffer_size=splits.num_train)
    with runner.scope():
        if runner.model_devices:  # One copy over this process's devices, in stages.
            model = Pipeline(reference_layers(splits.num_classes, job.hidden_units,
                                              job.hidden_layers),
                             input_shape=(splits.num_features,), name="reference_mlp")
        else:
            model = build_reference_model(splits.num_features, splits.num_classes,
                                          job.hidden_units, job.hidden_layers)
        model.compile(optimizer=runner.optimizer(make_optimizer(job)),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    throughput = Throughput(job.global_batch_size)
    peak_memory = PeakMemory()
    callbacks = [*runner.callbacks(), throughput, peak_memory]
    if job.tensorboard:
        callbacks.append(keras.callbacks.TensorBoard(
            runner.writable_dir(os.path.join(job.output_dir, "tensorboard"))))
    # A progress bar on a terminal; elsewhere (a pipe, a log file) one line per epoch:
    # Keras's bar takes every POSIX stream for a terminal (keras/src/utils/progbar.py,
    # `"posix" in sys.modules`) and redraws in place with carriage returns, so a log
    # holds every redraw and each epoch's last line twice.
    shows_bar = sys.stdout.isatty()
    history = model.fit(train_data, epochs=job.epochs, callbacks=callbacks,
                        shuffle=False,  # The dataset shuffles itself, once per epoch.
                        verbose=(1 if shows_bar else 2) if runner.is_chief else 0)
    test_loss, test_accuracy = model.evaluate(
        runner.dataset(splits.test, job.global_batch_size, drop_remainder=False), verbose=0)
    result = {
        "strategy": runner.strategy_name.value,
        "replicas": runner.num_replicas,
        "precision": runner.precision.name,
        "accumulation_steps": runner.config.accumulation_steps,
        "zero_stage": runner.config.zero_stage,
        # How stage 3 gathered the weights (`zero.reshard_after_forward`).
        "zero": dataclasses.asdict(runner.config.zero) if runner.config.zero_stage == 3 else None,
        # The devices this process spread the model over, and its stages' layer counts.
        "model_parallel": {"devices": list(runner.model_devices),
                           "micro_batches": runner.config.model_parallel.micro_batches,
                           "balance": model.balance} if runner.model_devices else None,
        # This process's optimizer state (its partition under zero_stage 1, 2 or 3).
        "optimizer_state_bytes": state_bytes(model.optimizer),
        # This process's allocator peak per device, over the process and during fit (None
        # on a CPU unless TF_CPU_ALLOCATOR_USE_BFC=true was set before TensorFlow started).
        "allocator_peak_bytes": peak_memory.to_dict(),
        "epochs": job.epochs,
        "global_batch_size": job.global_batch_size,  # one forward pass: the micro-batch
        "effective_batch_size": job.global_batch_size * runner.config.accumulation_steps,
        "dataset": job.dataset.value,
        # Epochs this process trained: fewer than `epochs` after a resume.
        "epochs_trained": len(history.epoch),
        "final_loss": _last(history, "loss"),
        "train_accuracy": _last(history, "accuracy"),
        "test_loss": float(test_loss),
        "accuracy": float(test_accuracy),
        "examples_per_sec": round(throughput.examples_per_sec, 1),
        "is_chief": runner.is_chief,
    }
    if runner.config.checkpoint.dir:
        result["checkpoint_dir"] = runner.config.checkpoint.dir
    if runner.is_chief:
        runner.save_config(job.output_dir)
        atomic_write_text(os.path.join(job.output_dir, "result.json"),
                          json.dumps(result, indent=2) + "\n")
    return result


def _last(history: keras.callbacks.History, key: str) -> float | None:
    """The last epoch's value, or None when this process trained no epoch (a finished run
    resumed from its last checkpoint)."""
    values = history.history.get(key)
    return float(values[-1]) if values else None
