"""The docs' Runner pattern, with `model.fit` at its defaults (Keras's progress bar on).

Run by tests/test_one_voice.py under `tfdist launch -n 2` and `mpirun -np 2`:

    python tests/scripts/one_voice.py --strategy S --epochs E --checkpoint_dir DIR \
        [--every_process_prints]
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", required=True)
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--checkpoint_dir", required=True)
    parser.add_argument("--every_process_prints", action="store_true")
    args = parser.parse_args()

    import keras
    import numpy as np
    import tensorflow as tf

    import tfdist

    runner = tfdist.Runner(tfdist.load_config(overrides={
        "strategy": args.strategy, "seed": 0,
        "every_process_prints": args.every_process_prints}))
    features = np.random.default_rng(0).random((512, 20), dtype="float32")
    ds = tf.data.Dataset.from_tensor_slices((features, (features.sum(1) > 10).astype("int32")))
    with runner.scope():
        model = keras.Sequential([keras.Input((20,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(2, activation="softmax")])
        model.compile(optimizer=runner.optimizer(keras.optimizers.Adam(1e-3)),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model.fit(runner.dataset(ds, global_batch_size=64), epochs=args.epochs,
              callbacks=runner.callbacks(checkpoint_dir=args.checkpoint_dir))


if __name__ == "__main__":
    main()
