"""Trains the reference convolutional model with synchronized BatchNormalization; each
process saves its weights.

Run by tests under `mpirun -np 2` (horovod, the adapter or the drop-in) or `tfdist launch
-n 2` (multi_worker), to compare with one device on the global batch:

    python tests/scripts/sync_batchnorm_training.py OUT_DIR --strategy horovod|multi_worker
        [--drop_in] [--without_fix]

Each process writes OUT_DIR/rank<R>.npz (all weights, moving statistics included).
--drop_in trains with tfdist.horovod.keras (DistributedOptimizer, SyncBatchNormalization,
the broadcast callback) instead of a tfdist Runner. --without_fix undoes
tfdist.patches.keras_normalization before training, to show the bare stack: Keras
synchronizes over tf.distribute replicas only, so each rank uses its own statistics.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402

from tests import reference  # noqa: E402

GLOBAL_BATCH, STEPS, EPOCHS = 16, 6, 2


def undo_fix_if_asked(without_fix):
    if without_fix:
        from tfdist.patches import keras_normalization

        assert keras_normalization.HOROVOD_SYNCHRONIZED_MOMENTS.undo()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--strategy", choices=["horovod", "multi_worker"], required=True)
    parser.add_argument("--drop_in", action="store_true")
    parser.add_argument("--without_fix", action="store_true")
    args = parser.parse_args()

    import keras
    import tensorflow as tf

    features, labels = reference.images(GLOBAL_BATCH * STEPS)
    if args.drop_in:
        import tfdist.horovod.keras as hvd

        hvd.init()
        rank = hvd.rank()
        undo_fix_if_asked(args.without_fix)
        model = reference.make_conv_model()
        model.set_weights(reference.initial_conv_weights())
        model.compile(hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                      "sparse_categorical_crossentropy")
        data = (tf.data.Dataset.from_tensor_slices((features, labels))
                .shard(hvd.size(), rank).batch(GLOBAL_BATCH // hvd.size()))
        model.fit(data, epochs=EPOCHS, verbose=0,
                  callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    else:
        import tfdist

        # The Runner first: it sets TensorFlow up before anything starts it.
        runner = tfdist.Runner(tfdist.load_config(overrides={"strategy": args.strategy}))
        start = reference.initial_conv_weights()
        cluster = runner.cluster
        rank = cluster.mpi.rank if cluster.mpi else cluster.tf_config.task_index
        with runner.scope():
            undo_fix_if_asked(args.without_fix)
            model = reference.make_conv_model()
            model.set_weights(start)
            model.compile(runner.optimizer(keras.optimizers.SGD(0.1)),
                          "sparse_categorical_crossentropy")
        data = runner.dataset(tf.data.Dataset.from_tensor_slices((features, labels)),
                              GLOBAL_BATCH)
        model.fit(data, epochs=EPOCHS, verbose=0, callbacks=runner.callbacks())
    np.savez(os.path.join(args.out_dir, f"rank{rank}.npz"),
             **{f"w_{index}": weight for index, weight in enumerate(model.get_weights())})


if __name__ == "__main__":
    main()
