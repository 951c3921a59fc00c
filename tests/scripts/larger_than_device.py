"""Trains an MLP whose float32 weights alone exceed each process's memory cap.

Run by tests/test_larger_than_device.py, with TF_CPU_ALLOCATOR_USE_BFC=true and
TF_CPU_BFC_MEM_LIMIT_IN_MB set (the cap a GPU's size would be):

    python tests/scripts/larger_than_device.py OUT_DIR one_device
    mpirun -np 8 python tests/scripts/larger_than_device.py OUT_DIR stage3 [--held]
    mpirun -np 8 python tests/scripts/larger_than_device.py OUT_DIR stage2
    ... --model gpt2  (keras-hub's GPT-2 from a small config, in place of the MLP)

Each process writes OUT_DIR/rank<R>.json: "trained" (and the allocator's peaks during fit
and over the process, in bytes), "out_of_memory" (and the first line of TensorFlow's
error) or "collective_failed" (a Horovod collective's error); after training,
OUT_DIR/rank<R>.npz holds the final weights.
The model, its initial weights and the batches are the same in every mode.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfdist  # noqa: E402
from tfdist.files import atomic_write_text  # noqa: E402
from tfdist.memory import PeakMemory  # noqa: E402

WIDTH = 800  # 40 Dense(800) layers: 25.6 M parameters, the largest layer 1/40 of them.
LAYERS = 40
GLOBAL_BATCH = 32
STEPS = 4


# keras-hub's GPT-2 from a small config: 12 decoder layers of width 384 and a tied embedding
# of 2,048 tokens, 22.1 M parameters; its largest weight (the embedding) holds 1/28 of them.
# Sequences of 16 tokens keep the activations (not sharded by any stage) small beside them.
GPT2_LENGTH = 16
GPT2 = dict(vocabulary_size=2048, num_layers=12, num_heads=6, hidden_dim=384,
            intermediate_dim=1536, max_sequence_length=GPT2_LENGTH, dropout=0.0)


def make_model(kind="mlp"):
    keras.utils.set_random_seed(5)
    if kind == "gpt2":
        import keras_hub

        return keras_hub.models.GPT2CausalLM(keras_hub.models.GPT2Backbone(**GPT2),
                                             preprocessor=None)
    layers = [keras.layers.Dense(WIDTH, activation="tanh", name=f"hidden_{i}")
              for i in range(LAYERS - 1)]
    return keras.Sequential([keras.Input((WIDTH,)), *layers,
                             keras.layers.Dense(WIDTH, name="out")])


def make_data(kind="mlp"):
    rng = np.random.default_rng(7)
    if kind == "gpt2":  # The next token of each position (the last one's: token 0).
        tokens = rng.integers(0, GPT2["vocabulary_size"], (GLOBAL_BATCH * STEPS, GPT2_LENGTH),
                              dtype="int32")
        return tf.data.Dataset.from_tensor_slices((
            {"token_ids": tokens, "padding_mask": np.ones_like(tokens)},
            np.concatenate([tokens[:, 1:], np.zeros_like(tokens[:, :1])], axis=1)))
    features = rng.normal(size=(GLOBAL_BATCH * STEPS, WIDTH)).astype("float32")
    return tf.data.Dataset.from_tensor_slices((features, np.tanh(features[:, ::-1])))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("mode", choices=["one_device", "stage2", "stage3"])
    parser.add_argument("--model", default="mlp", choices=["mlp", "gpt2"])
    parser.add_argument("--held", action="store_true",
                        help="stage 3 with zero.reshard_after_forward false")
    args = parser.parse_args()
    overrides = {"strategy": "one_device"}
    if args.mode != "one_device":
        overrides = {"strategy": "horovod", "zero_stage": int(args.mode[-1]),
                     "zero.reshard_after_forward": not args.held}
    runner = tfdist.Runner(tfdist.load_config(overrides=overrides))
    rank = 0
    if args.mode != "one_device":
        import horovod.tensorflow as hvd

        rank = hvd.rank()  # initialised by the Runner
    report = {"mode": args.mode, "held": args.held, "rank": rank}
    peak = PeakMemory()
    try:
        with runner.scope():
            model = make_model(args.model)
            optimizer = runner.optimizer(keras.optimizers.Adam(1e-3))
            # GPT-2's outputs are logits.
            model.compile(optimizer, "mse" if args.model == "mlp" else
                          keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(runner.dataset(make_data(args.model), GLOBAL_BATCH), epochs=1, verbose=0,
                  callbacks=[peak, *runner.callbacks()])
        # None where the allocator does not count (the uncapped reference run).
        peaks = (peak.to_dict() or {}).get("CPU:0", {})
        report.update(status="trained", parameters=int(model.count_params()),
                      fit_peak=peaks.get("fit"), process_peak=peaks.get("process"))
        weights = model.get_weights()
    except tf.errors.ResourceExhaustedError as error:
        report.update(status="out_of_memory", error=str(error).strip().splitlines()[0][:300])
        weights = None
    except tf.errors.UnknownError as error:
        # Horovod's allgather reports its allocator's refusal as "Unknown error." (and logs
        # "AllgatherOp::AllocateOutput failed" to the rank's stderr, which the test reads).
        report.update(status="collective_failed",
                      error=str(error).strip().splitlines()[0][:300])
        weights = None
    if weights is not None:
        np.savez(os.path.join(args.out, f"rank{rank}.npz"), *weights)
    # Atomic: mpirun ends a rank's peers as soon as one leaves, possibly mid-write, and the
    # test must read a whole report or none.
    atomic_write_text(os.path.join(args.out, f"rank{rank}.json"), json.dumps(report))
    if weights is None:
        # An out-of-memory rank's peers may wait in a collective it never joins: leave at
        # once (mpirun then ends the others).
        sys.stdout.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
