"""Trains a model spread over 2 devices per process (tfdist.parallel) through the Runner.

Under `mpirun -np 2` (strategy horovod: each rank one copy over its own 2 logical CPU
devices, the ranks data-parallel), or alone (strategy one_device):

    mpirun -np 2 python tests/scripts/parallel_training.py OUT_DIR --strategy horovod \
        --model pipeline|tensor [--epochs N] [--checkpoint_dir DIR] [--save_every_steps N] \
        [--kill_at_step N]
    mpirun -np 2 python tests/scripts/parallel_training.py OUT_DIR --variants JSON

`pipeline`: 4 Dense layers in a Pipeline, balance [2, 2], 4 micro-batches; `tensor`: a
ColumnParallelDense and RowParallelDense pair. Adam, global batch 32, 4 steps an epoch.
Each process writes OUT_DIR/rank<R>.npz (final weights, in a plain Sequential's layout)
and OUT_DIR/rank<R>.json: rank, ranks, iterations (at the end, and when the first batch
began: after a resume's restore), and the devices of its variables and Adam state.
--kill_at_step N SIGKILLs the process (rank 0 alone under one_device) when N steps in all
are done, after the checkpoint of step N if one is due.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import keras  # noqa: E402
import numpy as np  # noqa: E402

from tests import reference  # noqa: E402

FEATURES, OUTPUTS, HIDDEN = 8, 4, 16
GLOBAL_BATCH, STEPS = 32, 4
MICRO_BATCHES = 4


def plain_layers(model):
    """The plain Keras layers the parallel model stands for, freshly made."""
    if model == "pipeline":
        return [keras.layers.Dense(HIDDEN, activation="relu", name=f"block{index}")
                for index in range(3)] + [keras.layers.Dense(OUTPUTS, name="head")]
    return [keras.layers.Dense(HIDDEN, activation="relu", name="up"),
            keras.layers.Dense(OUTPUTS, name="down")]


def plain_model(model):
    return keras.Sequential([keras.Input((FEATURES,)), *plain_layers(model)])


def initial_weights(model):
    keras.utils.set_random_seed(5)
    return plain_model(model).get_weights()


def examples(steps=STEPS):
    rng = np.random.RandomState(0)
    return (rng.randn(steps * GLOBAL_BATCH, FEATURES).astype("float32"),
            rng.randn(steps * GLOBAL_BATCH, OUTPUTS).astype("float32"))


def parallel_model(model):
    """The model spread over the Runner's devices (built inside `runner.scope()`)."""
    from tfdist.parallel import ColumnParallelDense, Pipeline, RowParallelDense

    if model == "pipeline":
        return Pipeline(plain_layers(model), balance=[2, 2], input_shape=(FEATURES,))
    made = keras.Sequential([keras.Input((FEATURES,)),
                             ColumnParallelDense(HIDDEN, activation="relu", name="up"),
                             RowParallelDense(OUTPUTS, name="down")])
    return made


def set_plain_weights(made, model, weights):
    if model == "pipeline":
        made.set_weights(weights)
    else:
        for layer, pair in zip(made.layers, (weights[:2], weights[2:])):
            layer.set_weights(pair)


def plain_weights(made, model):
    if model == "pipeline":
        return made.get_weights()
    return [weight for layer in made.layers for weight in layer.get_weights()]


def parse(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--strategy", default="horovod", choices=["horovod", "one_device"])
    parser.add_argument("--model", default="pipeline", choices=["pipeline", "tensor"])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--checkpoint_dir")
    parser.add_argument("--save_every_steps", type=int, default=0)
    parser.add_argument("--kill_at_step", type=int)
    parser.add_argument("--variants", help="JSON: {name: [args, ...]}, trained in turn")
    return parser.parse_args(argv)


def train(args):
    import tensorflow as tf

    import tfdist

    runner = tfdist.Runner(tfdist.load_config(overrides={
        "strategy": args.strategy, "precision": "float32", "model_parallel.devices": 2,
        "model_parallel.micro_batches": MICRO_BATCHES}))
    if args.strategy == "horovod":
        import horovod.tensorflow as hvd

        rank, ranks = hvd.rank(), hvd.size()
    else:
        rank, ranks = 0, 1
    with runner.scope():
        made = parallel_model(args.model)
        set_plain_weights(made, args.model, initial_weights(args.model))
        made.compile(runner.optimizer(keras.optimizers.Adam(0.01)), "mse")
    data = runner.dataset(tf.data.Dataset.from_tensor_slices(examples()), GLOBAL_BATCH)
    callbacks = runner.callbacks(checkpoint_dir=args.checkpoint_dir,
                                 save_every_steps=args.save_every_steps)
    first_step = reference.FirstStep()
    callbacks.append(first_step)
    if args.kill_at_step and rank == 0:
        callbacks.append(reference.KillAt(args.kill_at_step))
    made.fit(data, epochs=args.epochs, callbacks=callbacks, verbose=0)

    def devices(variables):
        return sorted({v.value.device.split("device:")[-1] for v in variables})

    report = {"rank": rank, "ranks": ranks, "iterations": int(made.optimizer.iterations.numpy()),
              "iterations_at_start": first_step.iterations,
              "variable_devices": devices(made.trainable_variables),
              "slot_devices": devices([v for v in made.optimizer.variables if len(v.shape)])}
    os.makedirs(args.out_dir, exist_ok=True)
    np.savez(os.path.join(args.out_dir, f"rank{rank}.npz"), *plain_weights(made, args.model))
    # Each rank its own file: the ranks' standard outputs interleave under mpirun.
    with open(os.path.join(args.out_dir, f"rank{rank}.json"), "w") as stream:
        json.dump(report, stream)


if __name__ == "__main__":
    reference.run_variants(parse, train, sys.argv[1:])
