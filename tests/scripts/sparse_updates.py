"""Trains the Embedding model (sparse gradients) with several optimizers; each process reports.

Run by tests/test_sparse_gradients.py under each multi-process strategy, to compare with
the exact update (plain Keras, one device, each sparse gradient made dense):

    tfdist launch -n 2 -- python tests/scripts/sparse_updates.py OUT_DIR --strategy multi_worker
    mpirun -np 2 python tests/scripts/sparse_updates.py OUT_DIR --strategy horovod \
        --accumulation 1,2
    tfdist launch -n 1 --ps 1 -- python tests/scripts/sparse_updates.py OUT_DIR \
        --strategy parameter_server

Every optimizer of `OPTIMIZERS` trains a fresh model from the same start, for each
accumulation value (a Runner each: one launch trains every variant). Each process that
trains writes OUT_DIR/<process>.npz, one array list per variant under the names
`<optimizer>-k<accumulation>-<index>`; parameter servers and waiting workers write nothing.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import keras  # noqa: E402
import numpy as np  # noqa: E402

from tests import reference  # noqa: E402

GLOBAL_BATCH, STEPS = 32, 10  # one epoch; with accumulation k, micro-batches of 32 / k


def optimizers() -> dict:
    """The optimizers every strategy must update exactly with sparse gradients."""
    return {
        # Clipping is active at this norm (the test checks it moves the weights).
        "adam_global_clipnorm": keras.optimizers.Adam(0.01, global_clipnorm=0.1),
        "adamw": keras.optimizers.AdamW(0.01, weight_decay=0.1),
    }


def examples():
    return reference.examples(GLOBAL_BATCH * STEPS, embedding=True)


def process_name(runner) -> str:
    """`rank<R>` under Horovod, `<task type>-<index>` under TF_CONFIG, else `process`."""
    if runner.strategy_name.value == "horovod":
        import horovod.tensorflow as hvd

        return f"rank{hvd.rank()}"
    task = runner.cluster.tf_config
    return f"{task.task_type}-{task.task_index}" if task is not None else "process"


def train(strategy: str, accumulation: int) -> tuple[str, dict]:
    import tensorflow as tf

    import tfdist

    runner = tfdist.Runner(tfdist.load_config(overrides={
        "strategy": strategy, "precision": "float32", "accumulation_steps": accumulation}))
    data = runner.dataset(tf.data.Dataset.from_tensor_slices(examples()),
                          GLOBAL_BATCH // accumulation)
    start = reference.initial_weights(embedding=True)
    weights = {}
    for name, optimizer in optimizers().items():
        with runner.scope():
            model = reference.make_model(embedding=True)
            model.set_weights(start)
            model.compile(runner.optimizer(optimizer), "sparse_categorical_crossentropy")
        model.fit(data, epochs=1, verbose=0, callbacks=runner.callbacks())
        weights[f"{name}-k{accumulation}"] = model.get_weights()
    return process_name(runner), weights


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--strategy", required=True)
    parser.add_argument("--accumulation", default="1", help="comma-separated values")
    args = parser.parse_args()

    arrays, process = {}, None
    for accumulation in (int(value) for value in args.accumulation.split(",")):
        process, weights = train(args.strategy, accumulation)
        for variant, values in weights.items():
            arrays.update({f"{variant}-{index}": value for index, value in enumerate(values)})
    # Each process its own file: the processes' standard outputs interleave.
    os.makedirs(args.out_dir, exist_ok=True)
    np.savez(os.path.join(args.out_dir, f"{process}.npz"), **arrays)


if __name__ == "__main__":
    main()
