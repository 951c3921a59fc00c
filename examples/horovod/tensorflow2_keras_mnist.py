"""Horovod's examples/tensorflow2/tensorflow2_keras_mnist.py on tfdist.horovod.keras.

The one change a Horovod user makes is the import line: the model without an `Input`,
`compile(..., experimental_run_tf_function=False)`, the callbacks and `fit` are Horovod's.
The MNIST download is replaced by generated 28x28 digits-like images (a class-dependent
stroke plus noise), so the example runs without network access; the run's length is set
by flags, and rank 0 ends with a JSON summary.

    mpirun -np 2 python examples/horovod/tensorflow2_keras_mnist.py
    horovodrun --gloo -np 2 -H localhost:2 python examples/horovod/tensorflow2_keras_mnist.py

Rank 0 prints the training log and, last, one JSON line: ranks, epochs, loss, accuracy.
"""

import argparse
import json

import keras
import numpy as np
import tensorflow as tf

import tfdist.horovod.keras as hvd   # was: import horovod.tensorflow.keras as hvd


def generated_mnist(count, seed):
    """`count` 28x28x1 images in [0, 1] and labels 0-9: label k lights row 2 + 2k, plus noise."""
    rng = np.random.RandomState(seed)
    labels = rng.randint(0, 10, count)
    images = rng.uniform(0.0, 0.3, (count, 28, 28, 1)).astype("float32")
    images[np.arange(count), 2 + 2 * labels, 4:24, 0] = 1.0
    return images, labels.astype("int64")


def main():
    parser = argparse.ArgumentParser(description="TensorFlow 2 Keras MNIST (generated data)")
    parser.add_argument("--epochs", type=int, default=24)
    parser.add_argument("--steps_per_epoch", type=int, default=500)
    parser.add_argument("--batch_size", type=int, default=128)
    args = parser.parse_args()

    # Horovod: initialize Horovod.
    hvd.init()

    # Horovod: pin GPU to be used to process local rank (one GPU per process)
    gpus = tf.config.experimental.list_physical_devices('GPU')
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    if gpus:
        tf.config.experimental.set_visible_devices(gpus[hvd.local_rank()], 'GPU')

    mnist_images, mnist_labels = generated_mnist(6000, seed=hvd.rank())

    dataset = tf.data.Dataset.from_tensor_slices((mnist_images, mnist_labels))
    dataset = dataset.repeat().shuffle(10000, seed=hvd.rank()).batch(args.batch_size)

    mnist_model = tf.keras.Sequential([
        tf.keras.layers.Conv2D(32, [3, 3], activation='relu'),
        tf.keras.layers.Conv2D(64, [3, 3], activation='relu'),
        tf.keras.layers.MaxPooling2D(pool_size=(2, 2)),
        tf.keras.layers.Dropout(0.25),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(128, activation='relu'),
        tf.keras.layers.Dropout(0.5),
        tf.keras.layers.Dense(10, activation='softmax')
    ])

    # Horovod: adjust learning rate based on number of GPUs.
    scaled_lr = 0.001 * hvd.size()
    opt = tf.optimizers.Adam(scaled_lr)

    # Horovod: add Horovod DistributedOptimizer.
    opt = hvd.DistributedOptimizer(
        opt, backward_passes_per_step=1, average_aggregated_gradients=True)

    # Horovod: Specify `experimental_run_tf_function=False` to ensure TensorFlow
    # uses hvd.DistributedOptimizer() to compute gradients.
    mnist_model.compile(loss=tf.losses.SparseCategoricalCrossentropy(),
                        optimizer=opt,
                        metrics=['accuracy'],
                        experimental_run_tf_function=False)

    callbacks = [
        # Horovod: broadcast initial variable states from rank 0 to all other processes.
        # This is necessary to ensure consistent initialization of all workers when
        # training is started with random weights or restored from a checkpoint.
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),

        # Horovod: average metrics among workers at the end of every epoch.
        #
        # Note: This callback must be in the list before the ReduceLROnPlateau,
        # TensorBoard or other metrics-based callbacks.
        hvd.callbacks.MetricAverageCallback(),

        # Horovod: using `lr = 1.0 * hvd.size()` from the very beginning leads to worse final
        # accuracy. Scale the learning rate `lr = 1.0` ---> `lr = 1.0 * hvd.size()` during
        # the first three epochs. See https://arxiv.org/abs/1706.02677 for details.
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=3, verbose=1),
    ]

    # Horovod: save checkpoints only on worker 0 to prevent other workers from corrupting them.
    # (Keras 3 saves whole models as .keras files.)
    if hvd.rank() == 0:
        callbacks.append(keras.callbacks.ModelCheckpoint('./checkpoint-{epoch}.keras'))

    # Horovod: write logs on worker 0.
    verbose = 1 if hvd.rank() == 0 else 0

    # Train the model.
    # Horovod: adjust number of steps based on number of GPUs.
    history = mnist_model.fit(dataset, steps_per_epoch=args.steps_per_epoch // hvd.size(),
                              callbacks=callbacks, epochs=args.epochs, verbose=verbose)

    if hvd.rank() == 0:
        print(json.dumps({"ranks": hvd.size(), "epochs": len(history.history["loss"]),
                          "loss": history.history["loss"][-1],
                          "accuracy": history.history["accuracy"][-1],
                          "lr": history.history["lr"][-1]}))


if __name__ == '__main__':
    main()
