"""A classic Horovod Keras training script, run on every rank under mpirun or horovodrun.

Written as Horovod's documentation teaches: `hvd.init()`, the dataset sharded by rank
(each rank its half of each global batch), `hvd.DistributedOptimizer`, the broadcast
and metric-averaging callbacks. The module is chosen on the command line, so the same
script runs on tfdist's drop-in and on Horovod's own:

    mpirun -np 2 python tests/scripts/horovod_keras_script.py OUT_DIR \
        [--module tfdist.horovod.keras|horovod.tensorflow.keras] [--optimizer sgd|adam] \
        [--backward_passes N [--average_aggregated]] [--no_callbacks] [--same_start] \
        [--mixed_float16_inf_at STEP] [--option NAME=VALUE ...] [--as_horovod_docs]

Each rank writes OUT_DIR/rank<R>.npz (final weights) and OUT_DIR/rank<R>.json: rank,
size, iterations, history, allreduces (how many gradient allreduces ran, counted by a
counter placed around `horovod.tensorflow.grouped_allreduce` inside the traced step).
Rank r starts from `initial_weights(100 + r)` unless --same_start (all from seed 100):
only the broadcast makes them equal. --no_callbacks trains with DistributedOptimizer
alone (Horovod's own callbacks raise on Keras 3; its optimizer does not).
--mixed_float16_inf_at S trains under the mixed_float16 policy with an inf in rank 1's half
of step S (of the first epoch). --option passes one more DistributedOptimizer argument:
op=Sum|Adasum (the module's op), groups=N, groups=by_layer (each layer's variables one
group), gradient_predivide_factor=F, compression=fp16, sparse_as_dense=true.
--as_horovod_docs writes the model and compile as Horovod's TF2 Keras examples do: no
`keras.Input` (the model is built on its first batch, rank r's weights drawn from seed
100 + r) and `compile(..., experimental_run_tf_function=False)`.
--variants '{"NAME": [ARGS...], ...}' runs the script once per variant in this one launch,
each as if its ARGS were given alone, into OUT_DIR/NAME (one module for all of them):
starting TensorFlow and Horovod costs a launch more than one of these runs does.
"""

import argparse
import importlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402

from tests import reference  # noqa: E402

GLOBAL_BATCH, STEPS, EPOCHS = 32, 8, 2


_counter = {}  # The variable the wrapped grouped allreduce counts into (one per run).


def count_grouped_allreduces():
    """Counts each grouped allreduce that runs (a variable incremented beside it in the
    traced step, so it counts executions, not tracings); a new count on each call."""
    import horovod.tensorflow
    import tensorflow as tf

    _counter["variable"] = tf.Variable(0, dtype=tf.int64, trainable=False)
    if "wrapped" not in _counter:
        grouped_allreduce = _counter["wrapped"] = horovod.tensorflow.grouped_allreduce

        def counted(*args, **kwargs):
            _counter["variable"].assign_add(1)  # the run's own, read when its step is traced
            return grouped_allreduce(*args, **kwargs)

        horovod.tensorflow.grouped_allreduce = counted
    return _counter["variable"]


def optimizer_options(hvd, model, options):
    """DistributedOptimizer keyword arguments from NAME=VALUE strings."""
    import yaml

    parsed = {}
    for option in options:
        name, value = option.split("=", 1)
        if name == "op":
            parsed[name] = getattr(hvd, value)
        elif name == "compression":
            parsed[name] = getattr(hvd.Compression, value)
        elif name == "groups" and value == "by_layer":
            parsed[name] = [layer.trainable_variables for layer in model.layers
                            if layer.trainable_variables]
        else:
            parsed[name] = yaml.safe_load(value)
    return parsed


def make_model_without_input():
    """The reference model as Horovod's examples write theirs: no `keras.Input`."""
    import keras

    return keras.Sequential([keras.layers.Dense(16, activation="relu", name="hidden"),
                             keras.layers.Dense(reference.CLASSES, name="out"),
                             keras.layers.Activation("softmax", dtype="float32")])


def parse(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--module", default="tfdist.horovod.keras")
    parser.add_argument("--optimizer", default="sgd")
    parser.add_argument("--backward_passes", type=int, default=1)
    parser.add_argument("--average_aggregated", action="store_true")
    parser.add_argument("--no_callbacks", action="store_true")
    parser.add_argument("--same_start", action="store_true")
    parser.add_argument("--mixed_float16_inf_at", type=int)
    parser.add_argument("--option", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--as_horovod_docs", action="store_true")
    parser.add_argument("--variants", help="JSON: {name: [args, ...]}, run in turn")
    return parser.parse_args(argv)


def main():
    reference.run_variants(parse, train, sys.argv[1:])


def train(args):
    hvd = importlib.import_module(args.module)
    import keras
    import tensorflow as tf

    hvd.init()
    allreduces = count_grouped_allreduces()
    inf_at = args.mixed_float16_inf_at
    keras.config.set_dtype_policy("float32" if inf_at is None else "mixed_float16")
    features, labels = reference.examples(
        GLOBAL_BATCH * STEPS * args.backward_passes,
        inf_at=None if inf_at is None else inf_at * GLOBAL_BATCH + 1)  # odd: rank 1's shard
    dataset = (tf.data.Dataset.from_tensor_slices((features, labels))
               .shard(hvd.size(), hvd.rank())
               .batch(GLOBAL_BATCH // hvd.size()))

    seed = 100 if args.same_start else 100 + hvd.rank()
    if args.as_horovod_docs:
        keras.utils.set_random_seed(seed)  # the weights are drawn when fit builds the model
        model = make_model_without_input()
        compile_options = {"experimental_run_tf_function": False}
    else:
        model = reference.make_model()
        model.set_weights(reference.initial_weights(seed))
        compile_options = {}
    optimizer = hvd.DistributedOptimizer(reference.make_optimizer(args.optimizer),
                                         backward_passes_per_step=args.backward_passes,
                                         average_aggregated_gradients=args.average_aggregated,
                                         **optimizer_options(hvd, model, args.option))
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"], **compile_options)
    callbacks = [] if args.no_callbacks else [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.MetricAverageCallback()]
    history = model.fit(dataset, epochs=EPOCHS, callbacks=callbacks,
                        verbose=1 if hvd.rank() == 0 else 0)

    rank = hvd.rank()
    np.savez(os.path.join(args.out_dir, f"rank{rank}.npz"),
             **{f"w_{index}": weight for index, weight in enumerate(model.get_weights())})
    with open(os.path.join(args.out_dir, f"rank{rank}.json"), "w") as report:
        json.dump({"rank": rank, "size": hvd.size(),
                   "optimizer_class": type(model.optimizer).__name__,
                   "iterations": int(model.optimizer.iterations.numpy()),
                   "finite": bool(all(np.isfinite(w).all() for w in model.get_weights())),
                   "allreduces": int(allreduces.numpy()),
                   "history": {key: [float(value) for value in values]
                               for key, values in history.history.items()}}, report)


if __name__ == "__main__":
    main()
