"""A Horovod elastic Keras script (tfdist.horovod.keras) in which rank 1 dies mid-epoch.

Run by tests under `horovodrun --gloo -np 2 --min-np 1 -H localhost:1,127.0.0.1:1`:

    python tests/scripts/horovod_keras_elastic.py OUT_DIR --kill_at EPOCH:BATCH

Commits every 2 batches. Rank 1 SIGKILLs itself at the end of batch BATCH of epoch EPOCH
(0-based), once, after that batch's allreduce; rank 0 commits (BATCH odd) and then finds
rank 1 gone. Each rank writes OUT_DIR/rank<R>.json when it
finishes: the size, epoch and batch of each start of the training function, the state's
final epoch, the optimizer's iterations, and whether the weights are finite.
"""

import argparse
import json
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402

from tests import reference  # noqa: E402

GLOBAL_BATCH, STEPS, EPOCHS = 16, 8, 3


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--kill_at", default=None)
    args = parser.parse_args()

    import keras
    import tensorflow as tf

    import tfdist.horovod.keras as hvd

    hvd.init()
    features, labels = reference.examples(GLOBAL_BATCH * STEPS)
    model = reference.make_model()
    model.set_weights(reference.initial_weights())
    model.compile(hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                  "sparse_categorical_crossentropy")
    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    kill_epoch, kill_batch = map(int, args.kill_at.split(":")) if args.kill_at else (-1, -1)
    marker = os.path.join(args.out_dir, "killed")

    class KillRank1(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = state.epoch

        def on_train_batch_end(self, batch, logs=None):
            if (hvd.rank() == 1 and (self.epoch, batch) == (kill_epoch, kill_batch)
                    and not os.path.exists(marker)):
                open(marker, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)

    starts = []

    @hvd.elastic.run
    def train(state):
        starts.append({"size": hvd.size(), "epoch": state.epoch, "batch": state.batch})
        data = (tf.data.Dataset.from_tensor_slices((features, labels))
                .shard(hvd.size(), hvd.rank()).batch(GLOBAL_BATCH // hvd.size()))
        model.fit(data, epochs=EPOCHS - state.epoch, verbose=0, callbacks=[
            hvd.elastic.UpdateEpochStateCallback(state),
            hvd.elastic.UpdateBatchStateCallback(state),
            KillRank1(),
            hvd.elastic.CommitStateCallback(state, batches_per_commit=2)])

    train(state)
    with open(os.path.join(args.out_dir, f"rank{hvd.rank()}.json"), "w") as report:
        json.dump({"starts": starts, "epoch": state.epoch,
                   "iterations": int(model.optimizer.iterations.numpy()),
                   "finite": bool(all(np.isfinite(w).all() for w in model.get_weights()))},
                  report)


if __name__ == "__main__":
    main()
