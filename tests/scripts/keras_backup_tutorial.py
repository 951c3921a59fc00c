"""TensorFlow's multi-worker tutorial with Keras's own BackupAndRestore, on tfdist's strategy.

The tutorial (tensorflow/docs, site/en/tutorials/distribute/multi_worker_with_keras.ipynb)
builds `mnist_setup`'s CNN under `MultiWorkerMirroredStrategy`, then:

    callbacks = [tf.keras.callbacks.BackupAndRestore(backup_dir='/tmp/backup', save_freq=30)]
    with strategy.scope():
      multi_worker_model = mnist_setup.build_and_compile_cnn_model()
    multi_worker_model.fit(multi_worker_dataset, epochs=3, steps_per_epoch=70,
                           callbacks=callbacks)

Here the strategy is `tfdist.Runner(...).strategy` (Keras 3's fit does not run under a
bare MultiWorkerMirroredStrategy), MNIST is replaced by generated images of its shape (no
network), and the backup folder is BACKUP_DIR. Everything else is the tutorial's:

    tfdist launch -n 2 --max_restarts 1 -- python tests/scripts/keras_backup_tutorial.py \
        OUT_DIR BACKUP_DIR [--kill worker:1@1:40] [--undo]

--kill TASK@E:S: TASK SIGKILLs itself after step S of epoch E, once across restarts.
--undo removes tfdist's BackupAndRestore fixes (Keras 3 as installed). Each worker
writes OUT_DIR/<task>-<attempt>.json when fit returns: the epochs it trained and the
optimizer's iterations.
"""

import argparse
import json
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402


def mnist_dataset(batch_size):
    """mnist_setup.mnist_dataset, on 6,000 generated images of MNIST's shape and range."""
    rng = np.random.RandomState(0)
    x_train = rng.randint(0, 256, (6000, 28, 28)).astype("uint8") / np.float32(255)
    y_train = rng.randint(0, 10, 6000).astype(np.int64)
    train_dataset = tf.data.Dataset.from_tensor_slices(
        (x_train, y_train)).shuffle(60000).repeat().batch(batch_size)
    return train_dataset


def build_and_compile_cnn_model():
    """mnist_setup.build_and_compile_cnn_model, as the tutorial has it."""
    model = tf.keras.Sequential([
        tf.keras.layers.InputLayer(input_shape=(28, 28)),
        tf.keras.layers.Reshape(target_shape=(28, 28, 1)),
        tf.keras.layers.Conv2D(32, 3, activation='relu'),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(128, activation='relu'),
        tf.keras.layers.Dense(10)
    ])
    model.compile(
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer=tf.keras.optimizers.SGD(learning_rate=0.001),
        metrics=['accuracy'])
    return model


class KillOnce(tf.keras.callbacks.Callback):
    """SIGKILLs this process after step S of epoch E, the first time only."""

    def __init__(self, marker, epoch, step):
        super().__init__()
        self.marker, self.at, self.epoch = marker, (epoch, step), 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch + 1) == self.at and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("backup_dir")
    parser.add_argument("--kill", help="TASK@EPOCH:STEP, e.g. worker:1@1:40")
    parser.add_argument("--undo", action="store_true")
    args = parser.parse_args()

    import tfdist
    from tfdist.patches import keras_callbacks

    runner = tfdist.Runner(tfdist.load_config(overrides={"strategy": "multi_worker"}))
    if args.undo:
        keras_callbacks.BACKUP_ONE_WRITER.undo()
        keras_callbacks.BACKUP_ONE_CLEANER.undo()
    strategy = runner.strategy
    task = f"{runner.cluster.tf_config.task_type}:{runner.cluster.tf_config.task_index}"
    os.makedirs(args.out_dir, exist_ok=True)
    attempt = sum(name.startswith(task.replace(":", "-")) for name in os.listdir(args.out_dir))

    # The tutorial's cell, unchanged but for the folder.
    per_worker_batch_size = 64
    num_workers = runner.num_replicas
    global_batch_size = per_worker_batch_size * num_workers
    multi_worker_dataset = mnist_dataset(global_batch_size)
    callbacks = [tf.keras.callbacks.BackupAndRestore(backup_dir=args.backup_dir, save_freq=30)]
    with strategy.scope():
        multi_worker_model = build_and_compile_cnn_model()

    if args.kill and args.kill.split("@")[0] == task:
        epoch, step = (int(value) for value in args.kill.split("@")[1].split(":"))
        callbacks.append(KillOnce(os.path.join(args.out_dir, "killed"), epoch, step))
    history = multi_worker_model.fit(multi_worker_dataset, epochs=3, steps_per_epoch=70,
                                     callbacks=callbacks, verbose=0)
    with open(os.path.join(args.out_dir, f"{task.replace(':', '-')}-{attempt}.json"), "w") as f:
        json.dump({"epochs": history.epoch,
                   "iterations": int(multi_worker_model.optimizer.iterations.numpy())}, f)


if __name__ == "__main__":
    main()
