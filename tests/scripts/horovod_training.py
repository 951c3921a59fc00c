"""Trains a fixed model on fixed data on every Horovod rank; each rank reports and saves.

Run by tests under `mpirun -np 2`, to compare the ranks with each other and with
one_device:

    mpirun -np 2 python tests/scripts/horovod_training.py OUT_DIR \
        [--optimizer sgd|adam] [--steps N] [--seed_by_rank] [--precision P] \
        [--inf_at_step S] [--without broadcast|average|agreement] [--set KEY=VALUE] \
        [--embedding] [--bare]
    mpirun -np 2 python tests/scripts/horovod_training.py OUT_DIR --variants JSON

Each rank writes OUT_DIR/rank<R>.npz (final weights) and OUT_DIR/rank<R>.json: rank,
size, local_rank and local_size (Horovod's), iterations, history (as fit returned it),
local_history (each rank's own values, logged before tfdist averages them), loss_scale
(under mixed_float16).

--seed_by_rank initialises rank r's model with seed 100 + r (rank 0's initial
weights are saved too); otherwise every rank starts from seed 11's weights.
--inf_at_step S puts an inf into rank 1's slice of step S. --set horovod.op=sum (and
other config keys) is passed to the config. --embedding puts an Embedding layer
(sparse gradients) in front of the model. --fits N calls fit N times, epochs / N each.
--without drops one of tfdist's Horovod callbacks, or the agreement on skipped steps, to
show what it is for. --bare trains with Horovod's own Keras integration instead of tfdist.

--variants '{"NAME": [ARGS...], ...}' trains every variant in turn in this one launch,
each as if its ARGS were given alone, into OUT_DIR/NAME: starting TensorFlow and Horovod
costs a launch more than training one of these small runs does.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import keras  # noqa: E402
import numpy as np  # noqa: E402

from tests import reference  # noqa: E402
from tests.reference import make_optimizer  # noqa: E402

GLOBAL_BATCH = 32


def examples(steps, inf_at_step=None, embedding=False):
    """steps * GLOBAL_BATCH examples; with inf_at_step, one inf in rank 1's half of that step.

    With embedding, the features are token ids, for a model with an Embedding layer.
    """
    inf_at = None if inf_at_step is None else inf_at_step * GLOBAL_BATCH + GLOBAL_BATCH - 1
    return reference.examples(steps * GLOBAL_BATCH, embedding=embedding, inf_at=inf_at)


def make_model(embedding=False):
    """The reference MLP; with embedding, an Embedding layer (sparse gradients) in front."""
    return reference.make_model(embedding=embedding)


def initial_weights(seed, embedding=False):
    return reference.initial_weights(seed, embedding=embedding)


class LocalLogs(keras.callbacks.Callback):
    """Keeps each epoch's logs as this rank computed them (it runs before the averaging)."""

    def __init__(self):
        super().__init__()
        self.history = {}

    def on_epoch_end(self, epoch, logs=None):
        for key, value in (logs or {}).items():
            self.history.setdefault(key, []).append(float(value))


def count_reductions(optimizer):
    """Counts the calls of the gradient allreduce inside tfdist's optimizer wrappers."""
    import tensorflow as tf
    from tfdist.optimizers import GradientReducingOptimizer

    while not isinstance(optimizer, GradientReducingOptimizer):
        optimizer = optimizer.inner_optimizer
    reductions = tf.Variable(0, dtype=tf.int64, trainable=False)
    allreduce = optimizer.reduce_fn

    def counted(grads):
        reductions.assign_add(1)
        return allreduce(grads)

    optimizer.reduce_fn = counted
    return reductions


def parse(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--optimizer", default="sgd")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--seed_by_rank", action="store_true")
    parser.add_argument("--precision", default="float32")
    parser.add_argument("--inf_at_step", type=int)
    parser.add_argument("--without", choices=["broadcast", "average", "agreement"])
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--embedding", action="store_true")
    parser.add_argument("--fits", type=int, default=1, help="split the epochs over this many fits")
    parser.add_argument("--bare", action="store_true")
    parser.add_argument("--variants", help="JSON: {name: [args, ...]}, trained in turn")
    return parser.parse_args(argv)


def main():
    reference.run_variants(parse, train, sys.argv[1:])


def train(args):
    import tensorflow as tf

    features, labels = examples(args.steps, args.inf_at_step, args.embedding)
    if args.bare:
        import horovod.tensorflow.keras as hvd_keras

        hvd_keras.init()
        model = make_model()
        model.compile(hvd_keras.DistributedOptimizer(make_optimizer(args.optimizer)),
                      "sparse_categorical_crossentropy")
        model.fit(features, labels, batch_size=GLOBAL_BATCH // hvd_keras.size(), verbose=0,
                  callbacks=[hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0)])
        return

    import tfdist
    from tfdist.horovod.collectives import AverageMetrics, BroadcastState

    import yaml

    overrides = {"strategy": "horovod", "precision": args.precision}
    overrides.update((key, yaml.safe_load(value)) for key, value in
                     (setting.split("=", 1) for setting in args.set))
    runner = tfdist.Runner(tfdist.load_config(overrides=overrides))
    import horovod.tensorflow as hvd

    rank = hvd.rank()
    seed = 100 + rank if args.seed_by_rank else 11
    start = initial_weights(seed, args.embedding)
    with runner.scope():
        model = make_model(args.embedding)
        model.set_weights(start)
        model.compile(runner.optimizer(make_optimizer(args.optimizer)),
                      "sparse_categorical_crossentropy", metrics=["accuracy"])
    if args.without == "agreement":  # Keras's own skip decision: each rank for itself
        model.optimizer.finite_reduce_fn = None
    reductions = count_reductions(model.optimizer)
    dropped = {"broadcast": BroadcastState, "average": AverageMetrics}.get(args.without)
    callbacks = [callback for callback in runner.callbacks()
                 if dropped is None or not isinstance(callback, dropped)]
    local = LocalLogs()
    # With accumulation, micro-batches of 1/K of the global batch: K per update.
    micro_batch = GLOBAL_BATCH // runner.config.accumulation_steps
    data = runner.dataset(tf.data.Dataset.from_tensor_slices((features, labels)), micro_batch)
    for fit in range(args.fits):
        history = model.fit(data, epochs=args.epochs // args.fits, callbacks=[local, *callbacks],
                            verbose=0)
    optimizer = model.optimizer
    report = {"rank": rank, "size": hvd.size(), "local_rank": hvd.local_rank(),
              "local_size": hvd.local_size(), "iterations": int(optimizer.iterations.numpy()),
              "intra_op_threads": tf.config.threading.get_intra_op_parallelism_threads(),
              "reductions": int(reductions.numpy()),
              "history": history.history, "local_history": local.history}
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        report["loss_scale"] = float(optimizer.dynamic_scale.numpy())
    os.makedirs(args.out_dir, exist_ok=True)
    np.savez(os.path.join(args.out_dir, f"rank{rank}.npz"), *model.get_weights())
    if rank == 0:
        np.savez(os.path.join(args.out_dir, "start.npz"), *start)
    # Each rank its own file: the ranks' standard outputs interleave under mpirun.
    with open(os.path.join(args.out_dir, f"rank{rank}.json"), "w") as stream:
        json.dump(report, stream)


if __name__ == "__main__":
    main()
