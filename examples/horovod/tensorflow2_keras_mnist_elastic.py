"""Horovod's examples/elastic/tensorflow2/tensorflow2_keras_mnist_elastic.py, on
tfdist.horovod.keras.

Changes: the import line; generated data instead of the MNIST download (see
tensorflow2_keras_mnist.py); `compile` without `experimental_run_tf_function` and
`optimizer.learning_rate = ...` instead of `backend.set_value(optimizer.lr, ...)` (Keras
3); no one-step `fit` before the state is made or after a reset (Horovod needed it to
create the optimizer's variables; `KerasState` builds the optimizer itself, and the extra
step trained the model); `--epochs`/`--steps_per_epoch`/`--batch_size`; rank 0 prints one
JSON line at the end.

    horovodrun --gloo -np 2 --min-np 1 -H localhost:1,127.0.0.1:1 \
        python examples/horovod/tensorflow2_keras_mnist_elastic.py

(Horovod elastic needs two hosts: on one machine, two names for it.)

After a rank is lost, the others restore the last commit and go on. Keras 3 does not
let a callback shorten an epoch, so the epoch that was interrupted runs all its steps
again from the commit (`tfdist.Runner.run_elastic` resumes at the exact step).
"""

import argparse
import json

import keras
import tensorflow as tf

import tfdist.horovod.keras as hvd   # was: import horovod.tensorflow.keras as hvd
from tensorflow2_keras_mnist import generated_mnist

parser = argparse.ArgumentParser(description='Tensorflow 2.0 Keras MNIST Example')

parser.add_argument('--use-mixed-precision', action='store_true', default=False,
                    help='use mixed precision for training')
parser.add_argument('--epochs', type=int, default=24)
parser.add_argument('--steps_per_epoch', type=int, default=500)
parser.add_argument('--batch_size', type=int, default=128)

args = parser.parse_args()

if args.use_mixed_precision:
    keras.mixed_precision.set_global_policy('mixed_float16')

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
dataset = dataset.repeat().shuffle(10000).batch(args.batch_size)

model = keras.Sequential([
    keras.Input((28, 28, 1)),
    keras.layers.Conv2D(32, [3, 3], activation='relu'),
    keras.layers.Conv2D(64, [3, 3], activation='relu'),
    keras.layers.MaxPooling2D(pool_size=(2, 2)),
    keras.layers.Dropout(0.25),
    keras.layers.Flatten(),
    keras.layers.Dense(128, activation='relu'),
    keras.layers.Dropout(0.5),
    keras.layers.Dense(10, activation='softmax', dtype='float32')
])

# Horovod: adjust learning rate based on number of GPUs.
scaled_lr = 0.001 * hvd.size()
opt = keras.optimizers.Adam(scaled_lr)

# Horovod: add Horovod DistributedOptimizer.
opt = hvd.DistributedOptimizer(
    opt, backward_passes_per_step=1, average_aggregated_gradients=True)

model.compile(loss=keras.losses.SparseCategoricalCrossentropy(),
              optimizer=opt,
              metrics=['accuracy'])

state = hvd.elastic.KerasState(model, batch=0, epoch=0)


def on_state_reset():
    state.model.optimizer.learning_rate = 0.001 * hvd.size()


state.register_reset_callbacks([on_state_reset])

callbacks = [
    hvd.elastic.UpdateEpochStateCallback(state),
    hvd.elastic.UpdateBatchStateCallback(state),
    hvd.elastic.CommitStateCallback(state),
]

# Horovod: save checkpoints only on worker 0 to prevent other workers from corrupting them.
if hvd.rank() == 0:
    callbacks.append(keras.callbacks.ModelCheckpoint('./checkpoint-{epoch}.keras'))


# Train the model.
# Horovod: adjust number of steps based on number of GPUs.
@hvd.elastic.run
def train(state):
    return state.model.fit(dataset, steps_per_epoch=args.steps_per_epoch // hvd.size(),
                           epochs=args.epochs - state.epoch, callbacks=callbacks,
                           verbose=1 if hvd.rank() == 0 else 0)


history = train(state)
if hvd.rank() == 0:
    print(json.dumps({"ranks": hvd.size(), "epochs_done": state.epoch,
                      "loss": history.history["loss"][-1],
                      "accuracy": history.history["accuracy"][-1]}))
