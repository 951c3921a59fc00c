"""Trains a model with two Embeddings (two sparse gradients a step) on every Horovod rank.

Run by tests/adapters/test_two_embeddings.py under `mpirun -np 2`:

    mpirun -np 2 python tests/scripts/embeddings_training.py OUT_DIR --model bert \
        --stage 1 [--accumulation 2]
    mpirun -np 2 python tests/scripts/embeddings_training.py OUT_DIR --variants JSON
    python tests/scripts/embeddings_training.py OUT_DIR --strategy mirrored --model bert
    tfdist launch -n 2 -- python tests/scripts/embeddings_training.py OUT_DIR \
        --strategy multi_worker --model bert

Models: "pair", a token and a segment Embedding summed into a small MLP; "bert", keras-hub's
`BertTextClassifier` on a `BertBackbone` from a small config (random weights): a token,
a segment and a position embedding; "gpt2", keras-hub's `GPT2CausalLM` from a small config
(random weights), whose token embedding is read twice a step, tied: for the tokens and,
transposed, for the logits. Each rank writes OUT_DIR/rank<R>.npz (its weights).
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import keras  # noqa: E402
import numpy as np  # noqa: E402

from tests import reference  # noqa: E402

# The global batch divides by 2 and 3 ranks, and by both with accumulation_steps 2.
GLOBAL_BATCH, STEPS, LENGTH, VOCABULARY, SEGMENTS = 24, 4, 12, 200, 2


def make_model(kind):
    """The model, with fixed weights: the same on every rank and in one device's run."""
    keras.utils.set_random_seed(3)
    if kind == "gpt2":
        import keras_hub

        backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=VOCABULARY, num_layers=2, num_heads=2, hidden_dim=32,
            intermediate_dim=64, max_sequence_length=LENGTH, dropout=0.0)
        return keras_hub.models.GPT2CausalLM(backbone, preprocessor=None)
    if kind == "bert":
        import keras_hub

        backbone = keras_hub.models.BertBackbone(
            vocabulary_size=VOCABULARY, num_layers=2, num_heads=2, hidden_dim=32,
            intermediate_dim=64, max_sequence_length=LENGTH, dropout=0.0)
        return keras_hub.models.BertTextClassifier(backbone, num_classes=reference.CLASSES,
                                                   preprocessor=None, activation="softmax",
                                                   dropout=0.0)
    tokens = keras.Input((LENGTH,), dtype="int32", name="token_ids")
    segments = keras.Input((LENGTH,), dtype="int32", name="segment_ids")
    summed = keras.layers.Add()([keras.layers.Embedding(VOCABULARY, 8, name="token")(tokens),
                                 keras.layers.Embedding(SEGMENTS, 8, name="segment")(segments)])
    hidden = keras.layers.Dense(16, activation="relu")(keras.layers.Flatten()(summed))
    outputs = keras.layers.Dense(reference.CLASSES, activation="softmax")(hidden)
    return keras.Model({"token_ids": tokens, "segment_ids": segments}, outputs)


def examples(kind):
    """STEPS global batches: token ids (with repeats in a batch), segment ids, labels."""
    rng = np.random.RandomState(0)
    count = STEPS * GLOBAL_BATCH
    features = {"token_ids": rng.randint(0, VOCABULARY, (count, LENGTH)).astype("int32"),
                "segment_ids": rng.randint(0, SEGMENTS, (count, LENGTH)).astype("int32")}
    if kind == "bert":
        features["padding_mask"] = np.ones((count, LENGTH), "int32")
    if kind == "gpt2":  # The next token of each position (the last one's: token 0).
        tokens = features["token_ids"]
        return ({"token_ids": tokens, "padding_mask": np.ones((count, LENGTH), "int32")},
                np.concatenate([tokens[:, 1:], np.zeros((count, 1), "int32")], axis=1))
    return features, rng.randint(0, reference.CLASSES, count).astype("int32")


def train(strategy, kind, stage=0, accumulation=1, extra=None, epochs=2):
    """Trains `kind` under `strategy` (the Runner's config) and returns the model."""
    import tensorflow as tf

    import tfdist

    runner = tfdist.Runner(tfdist.load_config(overrides={
        "strategy": strategy, "zero_stage": stage, "accumulation_steps": accumulation,
        **(extra or {})}))
    with runner.scope():
        model = make_model(kind)
        # GPT-2's outputs are logits; the others' probabilities.
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=kind == "gpt2")
        model.compile(runner.optimizer(keras.optimizers.Adam(0.01, global_clipnorm=1.0)), loss)
    data = runner.dataset(tf.data.Dataset.from_tensor_slices(examples(kind)),
                          GLOBAL_BATCH // accumulation)
    model.fit(data, epochs=epochs, verbose=0, callbacks=runner.callbacks())
    return model


def parse(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--strategy", default="horovod",
                        choices=["horovod", "mirrored", "multi_worker"])
    parser.add_argument("--model", default="pair", choices=["pair", "bert", "gpt2"])
    parser.add_argument("--stage", type=int, default=0)
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--held", action="store_true",
                        help="zero.reshard_after_forward false (stage 3)")
    parser.add_argument("--prefetch", type=int, default=0, help="zero.prefetch (stage 3)")
    parser.add_argument("--bucket_mb", type=float, default=0.0, help="zero.bucket_mb (stage 3)")
    parser.add_argument("--precision", default="float32")
    parser.add_argument("--variants", help="JSON: {name: [args, ...]}, trained in turn")
    return parser.parse_args(argv)


def run(args):
    # mirrored: 2 replicas on 2 logical CPU devices of this process.
    extra = {"mirrored.cpu_replicas": 2} if args.strategy == "mirrored" else {}
    if args.held:
        extra["zero.reshard_after_forward"] = False
    extra.update({"zero.prefetch": args.prefetch, "zero.bucket_mb": args.bucket_mb,
                  "precision": args.precision})
    model = train(args.strategy, args.model, args.stage, args.accumulation, extra)
    if args.strategy == "horovod":
        import horovod.tensorflow as hvd

        rank = hvd.rank()
    else:  # The task's index among the workers tfdist launch started (0 under mirrored).
        rank = json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {}).get("index", 0)
    os.makedirs(args.out_dir, exist_ok=True)
    np.savez(os.path.join(args.out_dir, f"rank{rank}.npz"), *model.get_weights())


if __name__ == "__main__":
    reference.run_variants(parse, run, sys.argv[1:])
