"""Trains with the user's own file-writing and stopping callbacks, in every process alike.

Run by tests/test_saved_models.py under `tfdist launch -n 2` (multi_worker) and
`mpirun -np 2` (horovod):

    python tests/scripts/callback_files.py OUT_DIR --strategy multi_worker|horovod [--bare]

Each process works in a folder of its own, OUT_DIR/process<I>, and gives every callback
the same relative paths, as a script on a shared file system gives the same absolute
ones: whatever a process writes at the user's paths lands in its own folder, so the
test sees which process wrote what. The callbacks: ModelCheckpoint (the best `.keras`,
and `.weights.h5` every epoch), CSVLogger, TensorBoard, ReduceLROnPlateau and
EarlyStopping on the training loss. Each process writes OUT_DIR/report<I>.json: the
epochs it ran, the learning rate at each epoch's end, and its callbacks' private
folders (none on the chief). --bare undoes tfdist's one-writer patches of these
callbacks (Keras as installed).
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import keras  # noqa: E402
import numpy as np  # noqa: E402

EPOCHS = 12
GLOBAL_BATCH = 16


class LearningRates(keras.callbacks.Callback):
    """The optimizer's learning rate at each epoch's end."""

    def __init__(self):
        super().__init__()
        self.rates = []

    def on_epoch_end(self, epoch, logs=None):
        self.rates.append(float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate)))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--strategy", required=True)
    parser.add_argument("--bare", action="store_true")
    args = parser.parse_args()

    import tensorflow as tf

    import tfdist
    from tfdist.cluster import detect_cluster

    cluster = detect_cluster(probe_gpus=False)
    index = cluster.mpi.rank if cluster.mpi else cluster.tf_config.task_index
    folder = os.path.join(args.out, f"process{index}")
    os.makedirs(folder)
    os.chdir(folder)

    runner = tfdist.Runner(tfdist.load_config(overrides={"strategy": args.strategy,
                                                         "seed": 0}))
    if args.bare:
        from tfdist import patches
        from tfdist.patches import keras_callbacks

        patches.undo(keras_callbacks.USER_FILE_WRITERS)
    rng = np.random.default_rng(3)
    features = rng.standard_normal((128, 6)).astype("float32")
    targets = features @ rng.standard_normal((6, 1)).astype("float32")
    data = runner.dataset(tf.data.Dataset.from_tensor_slices((features, targets)),
                          global_batch_size=GLOBAL_BATCH)
    with runner.scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(1)])
        model.set_weights([np.zeros((6, 1), "float32"), np.zeros((1,), "float32")])
        model.compile(runner.optimizer(keras.optimizers.SGD(0.05)), "mse")
    rates = LearningRates()
    users = [
        keras.callbacks.ModelCheckpoint("checkpoints/best.keras", monitor="loss",
                                        save_best_only=True),
        keras.callbacks.ModelCheckpoint("checkpoints/epoch{epoch}.weights.h5",
                                        save_weights_only=True),
        keras.callbacks.CSVLogger("training.csv"),
        keras.callbacks.TensorBoard("logs"),
        # The loss falls fast, then slowly: the rate is cut, then training stops.
        keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0,
                                          min_delta=0.05),
        keras.callbacks.EarlyStopping(monitor="loss", patience=1, min_delta=0.02),
    ]
    history = model.fit(data, epochs=EPOCHS, verbose=0,
                        callbacks=[*runner.callbacks(), *users, rates])
    report = {"epochs": len(history.epoch), "rates": rates.rates,
              "losses": history.history["loss"],
              "scratch": sorted({c._tfdist_scratch for c in users
                                 if getattr(c, "_tfdist_scratch", None)})}
    with open(os.path.join(args.out, f"report{index}.json"), "w") as file:
        json.dump(report, file)


if __name__ == "__main__":
    main()
