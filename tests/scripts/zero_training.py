"""Trains the reference model with sharded training state (zero_stage) on every Horovod rank.

Run by tests under `mpirun -np 2` or `-np 3`:

    mpirun -np 2 python tests/scripts/zero_training.py OUT_DIR --stage 2 --optimizer adam_clip \
        [--steps N] [--epochs N] [--accumulation K] [--precision P] [--inf_at_step S] \
        [--model embedding|deferred|dense|two_inputs|subclassed|dropout_bn] \
        [--checkpoint_dir DIR] [--save_every_steps N] \
        [--kill_at_step N] [--save_model] [--held]
    mpirun -np 2 python tests/scripts/zero_training.py OUT_DIR --variants JSON

Each rank writes OUT_DIR/rank<R>.npz (final weights) and OUT_DIR/rank<R>.json: rank, ranks,
iterations (at the end, and when the first batch began: after a resume's restore),
state_bytes (its optimizer's variables), the partition it updates, the largest variable's
bytes, loss_scale (mixed_float16). With --save_model the chief saves
OUT_DIR/model.keras after fit; with --stage 0 each rank also writes its optimizer's
variables (the user's optimizer's, inside tfdist's wrappers) to OUT_DIR/optimizer<R>.npz.
--kill_at_step N SIGKILLs rank 1 when N steps in all are done (after the checkpoint of
step N, if one is due). --inf_at_step S puts an inf into the last rank's slice of step S.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import keras  # noqa: E402
import numpy as np  # noqa: E402

from tests import reference  # noqa: E402

GLOBAL_BATCH = 48  # Divides by 2 and by 3 ranks.
DEFERRED_SEED = 100  # Rank r of a --model deferred run draws its weights from seed 100 + r.


def optimizers():
    """The optimizers the tests shard, by name (each made fresh)."""
    def adamw():
        optimizer = keras.optimizers.AdamW(0.01, weight_decay=0.1)
        optimizer.exclude_from_weight_decay(var_names=["bias"])
        return optimizer

    return {
        # Clipping that acts: the gradients' global norm is about 0.5 here.
        "adam_clip": lambda: keras.optimizers.Adam(0.01, global_clipnorm=0.1),
        "adam_clipnorm": lambda: keras.optimizers.Adam(0.01, clipnorm=0.05),
        "adamw": adamw,
        "sgd_momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
        "adam_ema": lambda: keras.optimizers.Adam(0.01, use_ema=True, ema_momentum=0.9),
        "adam": lambda: keras.optimizers.Adam(0.01),
        "lamb": lambda: keras.optimizers.Lamb(0.01),
    }


class Classifier(keras.Model):
    """The reference model written as a subclass, its layers made in __init__."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.table = keras.layers.Embedding(reference.VOCABULARY, 8)
        self.flatten = keras.layers.Flatten()
        self.hidden = keras.layers.Dense(16, activation="relu")
        self.out = keras.layers.Dense(reference.CLASSES)

    def call(self, tokens):
        return keras.ops.softmax(self.out(self.hidden(self.flatten(self.table(tokens)))))


class DenseWithDropout(keras.layers.Layer):
    """A user's layer that drops some of its inputs inside its own call (a seed
    generator's state beside its kernel)."""

    def __init__(self, units, rate, **kwargs):
        super().__init__(**kwargs)
        self.units, self.rate = units, rate
        self.seed_generator = keras.random.SeedGenerator(3)

    def build(self, input_shape):
        self.kernel = self.add_weight((input_shape[-1], self.units), name="kernel")

    def call(self, inputs, training=False):
        if training:
            inputs = keras.random.dropout(inputs, self.rate, seed=self.seed_generator)
        return keras.ops.matmul(inputs, self.kernel)


def make_model(kind):
    """The reference model with an Embedding (sparse gradients); "deferred": the same layers
    with no `keras.Input`, built on their first batch inside `fit` (as Horovod's examples
    write models); one Dense layer (2 variables: a third rank owns none at stage 1);
    "two_inputs": a functional model of token ids and float features; "subclassed": the
    reference model as a keras.Model subclass; "dropout_bn": Dropout, BatchNormalization
    and a layer that drops inside its own call, between the reference model's layers."""
    if kind == "embedding":
        return reference.make_model(embedding=True)
    if kind == "two_inputs":
        tokens = keras.Input((reference.FEATURES,), dtype="int32", name="tokens")
        values = keras.Input((reference.FEATURES,), name="values")
        embedded = keras.layers.Flatten()(keras.layers.Embedding(reference.VOCABULARY, 8)(tokens))
        joined = keras.layers.Concatenate()([embedded, keras.layers.Dense(8)(values)])
        hidden = keras.layers.Dense(16, activation="relu")(joined)
        outputs = keras.layers.Activation("softmax")(keras.layers.Dense(reference.CLASSES)(hidden))
        return keras.Model({"tokens": tokens, "values": values}, outputs)
    if kind == "subclassed":  # Built as users build one: called on a batch.
        model = Classifier()
        model(np.zeros((1, reference.FEATURES), "int32"))
        return model
    if kind == "dropout_bn":
        return keras.Sequential([
            keras.Input((reference.FEATURES,), dtype="int32"),
            keras.layers.Embedding(reference.VOCABULARY, 8), keras.layers.Flatten(),
            keras.layers.Dense(16, activation="relu"), keras.layers.BatchNormalization(),
            keras.layers.Dropout(0.3), DenseWithDropout(16, 0.3),
            keras.layers.Dense(reference.CLASSES, activation="softmax")])
    if kind == "deferred":
        # New layers (those of a model with a keras.Input would be built already, their
        # weights drawn from whatever state the process's random generator was in).
        return keras.Sequential(reference.make_model(embedding=True, with_input=False).layers)
    return keras.Sequential([keras.Input((reference.FEATURES,)),
                             keras.layers.Dense(reference.CLASSES, name="out"),
                             keras.layers.Activation("softmax", dtype="float32")])


def initial_weights(kind):
    keras.utils.set_random_seed(11)
    return [weight.copy() for weight in make_model(kind).get_weights()]


def examples(kind, steps, inf_at_step=None):
    inf_at = None if inf_at_step is None else (inf_at_step + 1) * GLOBAL_BATCH - 1
    features, labels = reference.examples(steps * GLOBAL_BATCH, embedding=kind != "dense",
                                          inf_at=inf_at)
    if kind == "two_inputs":
        values, _ = reference.examples(len(features), seed=1)
        features = {"tokens": features, "values": values}
    return features, labels


def parse(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--optimizer", default="adam_clip", choices=sorted(optimizers()))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--precision", default="float32")
    parser.add_argument("--inf_at_step", type=int)
    parser.add_argument("--model", default="embedding",
                        choices=["embedding", "deferred", "dense", "two_inputs",
                                 "subclassed", "dropout_bn"])
    parser.add_argument("--checkpoint_dir")
    parser.add_argument("--save_every_steps", type=int, default=0)
    parser.add_argument("--kill_at_step", type=int)
    parser.add_argument("--save_model", action="store_true")
    parser.add_argument("--held", action="store_true",
                        help="zero.reshard_after_forward false: gathered weights held to the "
                             "backward pass")
    parser.add_argument("--prefetch", type=int, default=0, help="zero.prefetch (stage 3)")
    parser.add_argument("--bucket_mb", type=float, default=0.0, help="zero.bucket_mb (stage 3)")
    parser.add_argument("--unit", default="",
                        help="zero.unit (stage 3): layer names, comma-separated")
    parser.add_argument("--float64", action="store_true",
                        help="the model's weights and compute in float64 (Keras's global "
                             "dtype policy while it is built): a comparison past float32's "
                             "rounding")
    parser.add_argument("--variants", help="JSON: {name: [args, ...]}, trained in turn")
    return parser.parse_args(argv)


def train(args):
    import tensorflow as tf

    import tfdist
    from tfdist.sharding import find_sharded, state_bytes, units_of
    from tfdist.sharding.weights import gradient_shape, is_sharded

    runner = tfdist.Runner(tfdist.load_config(overrides={
        "strategy": "horovod", "precision": args.precision, "zero_stage": args.stage,
        "accumulation_steps": args.accumulation,
        "zero.reshard_after_forward": not args.held, "zero.prefetch": args.prefetch,
        "zero.bucket_mb": args.bucket_mb,
        "zero.unit": [name for name in args.unit.split(",") if name]}))
    import horovod.tensorflow as hvd

    rank, ranks = hvd.rank(), hvd.size()
    with runner.scope():
        if args.float64:
            # The layers' policy (the scope restores the precision's after it), and floatx:
            # Keras's losses compute in floatx, whatever the policy.
            keras.config.set_dtype_policy("float64")
            keras.config.set_floatx("float64")
        if args.model == "deferred":
            # Its weights are drawn in fit, from a seed of each rank's own (Keras draws
            # each initializer's seed as the layer is made): only the broadcast of rank
            # 0's makes the ranks start alike.
            keras.utils.set_random_seed(DEFERRED_SEED + rank)
        elif args.model == "dropout_bn":  # The same dropout masks in every run of it.
            keras.utils.set_random_seed(DEFERRED_SEED)
        model = make_model(args.model)
        if args.model != "deferred":
            # (At zero_stage 3 the model made here is stored sharded too, and its
            # get_weights gathers on every rank alike.)
            model.set_weights(initial_weights(args.model))
        model.compile(runner.optimizer(optimizers()[args.optimizer]()),
                      "sparse_categorical_crossentropy")
    features, labels = examples(args.model, args.steps, args.inf_at_step)
    data = runner.dataset(tf.data.Dataset.from_tensor_slices((features, labels)),
                          GLOBAL_BATCH // args.accumulation)
    callbacks = runner.callbacks(checkpoint_dir=args.checkpoint_dir,
                                 save_every_steps=args.save_every_steps)
    first_step = reference.FirstStep()
    callbacks.append(first_step)
    if args.kill_at_step and rank == 1:
        callbacks.append(reference.KillAt(args.kill_at_step))
    model.fit(data, epochs=args.epochs, callbacks=callbacks, verbose=0)
    keras.config.set_floatx("float32")  # for the variants after this one
    evaluated = None
    if args.stage == 3:
        # Every rank evaluates the whole training set, each step gathering the weights.
        evaluated = float(model.evaluate(runner.dataset(
            tf.data.Dataset.from_tensor_slices((features, labels)), GLOBAL_BATCH,
            drop_remainder=False), verbose=0))
    optimizer = model.optimizer
    sharded = find_sharded(optimizer)
    report = {"rank": rank, "ranks": ranks, "iterations": int(optimizer.iterations.numpy()),
              "iterations_at_start": first_step.iterations,
              "evaluate_loss": evaluated,
              "state_bytes": state_bytes(optimizer),
              "largest_variable_bytes": max(int(np.prod(v.shape)) * 4
                                            for v in model.trainable_variables),
              # What this rank stores of the trainable weights (a slice of each at stage 3).
              "weight_bytes": sum(int(np.prod(v._value.shard.shape if is_sharded(v) else
                                              v.shape)) * 4 for v in model.trainable_variables),
              # What the backward pass gives it of each gradient (a slice at stages 2, 3).
              "gradient_bytes": sum(int(np.prod(gradient_shape(v))) * 4
                                    for v in model.trainable_variables),
              # The layers whose weights stage 3 gathers again in the backward pass.
              "units": [unit.name for unit in units_of(model)],
              "partition": [] if sharded is None else [
                  [p.variable, p.start, p.stop] for p in sharded.partition]}
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        report["loss_scale"] = float(optimizer.dynamic_scale.numpy())
    os.makedirs(args.out_dir, exist_ok=True)
    np.savez(os.path.join(args.out_dir, f"rank{rank}.npz"), *model.get_weights())
    if args.stage == 0:
        users = optimizer
        while hasattr(users, "inner_optimizer"):  # The user's Adam inside tfdist's wrappers.
            users = users.inner_optimizer
        np.savez(os.path.join(args.out_dir, f"optimizer{rank}.npz"),
                 *[v.numpy() for v in users.variables])
    if args.save_model and rank == 0:
        model.save(os.path.join(args.out_dir, "model.keras"))
    # Each rank its own file: the ranks' standard outputs interleave under mpirun.
    with open(os.path.join(args.out_dir, f"rank{rank}.json"), "w") as stream:
        json.dump(report, stream)


if __name__ == "__main__":
    reference.run_variants(parse, train, sys.argv[1:])
