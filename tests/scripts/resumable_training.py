"""A training run that can be killed, preempted or stalled at chosen steps, and resumed.

Run by the fault-tolerance tests, alone or under `tfdist launch`, `mpirun`, `horovodrun`:

    python tests/scripts/resumable_training.py OUT_DIR --strategy S --checkpoint_dir DIR \
        [--epochs 3] [--save_every 4] [--accumulation_steps K] [--steps_per_execution N] \
        [--precision P] \
        [--kill TASK@E:S ...] [--sigterm TASK@E:S ...] [--stall_at TASK@E:S:SECONDS] \
        [--keras_backup] [--timeout SECONDS] [--bare] [--user_shuffle SEED|unseeded]

The run: 3 epochs of 12 steps (global batch 16 over 192 examples) of an MLP with
Dropout, Adam, a shuffle seeded by (seed, epoch) through `runner.dataset`, and a
checkpoint every 4 steps. Every example's features end with its id, which the model
drops, and each replica records the ids of every step it trains.

Each process writes, in OUT_DIR, for attempt A (0 for the first start, 1 after a
restart, ...):
- `steps-TASK-A.jsonl`: one line per step trained: epoch, step (1-based in the epoch),
  and this process's ids, replica by replica;
- `final-TASK.json` at the end: iterations, History, the checkpoint restored;
- `weights.npz` (the chief): the final weights.
TASK is `main`, `worker0`, `chief0` or `rank0`, ... .

Faults, each acted on once across restarts (a marker file in OUT_DIR remembers):
- `--kill TASK@E:S`: TASK SIGKILLs itself at the end of step S of epoch E (1-based
  step, 0-based epoch), after that step's checkpoint, if one is due;
- `--kill_in_save TASK@N`: TASK SIGKILLs itself inside the save of global step N, once
  the checkpoint's files are written and before it is recorded as the newest;
- `--sigterm TASK@E:S`: TASK sends itself SIGTERM there;
- `--stall_at TASK@E:S:SECONDS`: TASK sleeps there, in Python, alive but not training;
  it first writes the time to `stalled-TASK.json` (not `--stall`: `horovodrun` reads
  its own flags after the command too, and takes that for a prefix of its `--stall-check`);
- `--sigterm_in_trace TASK`: TASK sends itself SIGTERM while Keras traces the first step;
- `--sigterm_in_validation TASK@E`: TASK sends itself SIGTERM as epoch E's validation
  starts (with `--validation`, which evaluates on held-out examples after every epoch).
A process that fails writes `error-TASK.json`: the time, the error's type and message.
`--user_shuffle SEED` shuffles in the pipeline itself, as users write it:
`dataset.shuffle(n, seed=SEED)` (reshuffled each epoch), and no `runner.dataset`
shuffle; `--user_shuffle unseeded` with no seed and no global seed.
`--keras_backup` uses Keras's own `keras.callbacks.BackupAndRestore` instead of
tfdist's (the bare stack's behaviour). `--bare` drops tfdist: a plain
MultiWorkerMirroredStrategy with its default (no) collective timeout.
"""

import argparse
import json
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

EXAMPLES, GLOBAL_BATCH, FEATURES, CLASSES = 192, 16, 6, 3  # 12 steps per epoch
VALIDATION_EXAMPLES = 40
SEED = 5


def examples(seed=0, count=EXAMPLES):
    """Features with each example's id as the last column, and labels."""
    rng = np.random.RandomState(seed)
    features = rng.randn(count, FEATURES).astype("float32")
    ids = np.arange(count, dtype="float32")[:, None]
    labels = rng.randint(0, CLASSES, count).astype("int32")
    return np.concatenate([features, ids], axis=1), labels


class RecordingModel(keras.Model):
    """Records the example ids of every step each replica trains (they are not trained on).

    Not under parameter_server: its steps run on the workers, which cannot call back
    into this process's Python.
    """

    recorded = []
    enabled = True
    sigterm_in_trace = None  # (out_dir, task) of a process to signal while tracing.

    def train_step(self, data):
        # Python here runs only while Keras traces the step.
        if RecordingModel.sigterm_in_trace and once(*RecordingModel.sigterm_in_trace):
            os.kill(os.getpid(), signal.SIGTERM)
        if not RecordingModel.enabled:
            return super().train_step(data)
        features, _ = data
        replica = tf.distribute.get_replica_context().replica_id_in_sync_group
        tf.py_function(lambda r, ids: RecordingModel.recorded.append(
            (int(r), ids.numpy().astype(int).tolist())), [replica, features[:, -1]], [])
        return super().train_step(data)


def make_model():
    inputs = keras.Input((FEATURES + 1,))
    x = keras.layers.Lambda(lambda t: t[:, :-1], name="drop_id")(inputs)
    x = keras.layers.Dense(32, activation="relu")(x)
    x = keras.layers.Dropout(0.3)(x)
    x = keras.layers.Dense(CLASSES)(x)
    x = keras.layers.Activation("softmax", dtype="float32")(x)  # float32 under mixed precision
    return RecordingModel(inputs, x)


def task_name(runner):
    cluster = runner.cluster
    if cluster.tf_config is not None:
        return f"{cluster.tf_config.task_type}{cluster.tf_config.task_index}"
    if cluster.mpi is not None:
        return f"rank{cluster.mpi.rank}"
    return "main"


def fault_points(specs):
    """{(task, epoch, step): extra} from TASK@E:S[:EXTRA] specs."""
    points = {}
    for spec in specs or []:
        task, where = spec.split("@")
        epoch, step, *extra = where.split(":")
        points[(task, int(epoch), int(step))] = float(extra[0]) if extra else None
    return points


def once(out_dir, name):
    """True the first time it is asked for `name` in this run directory."""
    marker = os.path.join(out_dir, f"done-{name}")
    if os.path.exists(marker):
        return False
    with open(marker, "w"):
        pass
    return True


class StepRecorder(keras.callbacks.Callback):
    """Writes the ids this process trained at each step (first in the list of callbacks)."""

    def __init__(self, path):
        super().__init__()
        self.path = path
        self.epoch = 0
        self.iterations_at_start = []  # At the first step of each fit, after any restore.
        self.started = False

    def on_train_begin(self, logs=None):
        self.started = False

    def on_train_batch_begin(self, batch, logs=None):
        if not self.started:
            self.started = True
            self.iterations_at_start.append(int(self.model.optimizer.iterations.numpy()))

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch
        RecordingModel.recorded.clear()

    def on_train_batch_end(self, batch, logs=None):
        if not RecordingModel.recorded:  # A step skipped on resume: nothing was trained.
            return
        ids = [ids for _, ids in sorted(RecordingModel.recorded, key=lambda r: r[0])]
        RecordingModel.recorded.clear()
        with open(self.path, "a") as stream:
            stream.write(json.dumps({"epoch": self.epoch, "step": batch + 1, "ids": ids}) + "\n")
            stream.flush()
            os.fsync(stream.fileno())


class Faults(keras.callbacks.Callback):
    """Acts out the faults at the end of their steps (last in the list, after any save)."""

    def __init__(self, out_dir, task, faults, sigterm_in_validation=()):
        super().__init__()
        self.out_dir, self.task, self.faults = out_dir, task, faults
        self.sigterm_in_validation = sigterm_in_validation
        self.epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_test_begin(self, logs=None):
        if (f"{self.task}@{self.epoch}" in self.sigterm_in_validation
                and once(self.out_dir, f"sigterm_in_validation-{self.task}@{self.epoch}")):
            os.kill(os.getpid(), signal.SIGTERM)

    def on_train_batch_end(self, batch, logs=None):
        key = (self.task, self.epoch, batch + 1)
        for kind, points in self.faults.items():
            if key not in points or not once(self.out_dir, f"{kind}-{key}"):
                continue
            if kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif kind == "sigterm":
                os.kill(os.getpid(), signal.SIGTERM)
            elif kind == "stall":
                with open(os.path.join(self.out_dir, f"stalled-{self.task}.json"), "w") as f:
                    json.dump({"at": time.time()}, f)
                time.sleep(points[key])


def kill_inside_save(out_dir, task, number):
    """SIGKILLs this process inside the save of checkpoint `number`, after its files are
    written and before the folder's state names it."""
    manager_cls = tf.train.CheckpointManager
    record = manager_cls._record_state

    def record_state(self):
        saving = int(self._latest_checkpoint.rsplit("-", 1)[1])
        if saving == number and once(out_dir, f"kill_in_save-{task}@{number}"):
            os.kill(os.getpid(), signal.SIGKILL)
        return record(self)

    manager_cls._record_state = record_state


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--strategy", default="one_device")
    parser.add_argument("--checkpoint_dir")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--save_every", type=int, default=4)
    parser.add_argument("--accumulation_steps", type=int, default=1)
    parser.add_argument("--steps_per_execution", type=int, default=1)
    parser.add_argument("--precision", default="float32")
    parser.add_argument("--kill", action="append")
    parser.add_argument("--kill_in_save")
    parser.add_argument("--sigterm", action="append")
    parser.add_argument("--stall_at", action="append")
    parser.add_argument("--sigterm_in_trace")
    parser.add_argument("--sigterm_in_validation", action="append", default=[])
    parser.add_argument("--validation", action="store_true")
    parser.add_argument("--timeout", type=float, help="multi_worker/horovod timeout_seconds")
    parser.add_argument("--keras_backup", action="store_true")
    parser.add_argument("--bare", action="store_true")
    parser.add_argument("--elastic", action="store_true",
                        help="horovod under horovodrun --min-np: runner.run_elastic")
    parser.add_argument("--scale_learning_rate", action="store_true")
    parser.add_argument("--user_shuffle", help="a seed, or 'unseeded'")
    args = parser.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    if args.bare:
        return bare_multi_worker(args)

    import tfdist

    seed = None if args.user_shuffle == "unseeded" else SEED  # None: no global seed either
    overrides = {"strategy": args.strategy, "precision": args.precision, "seed": seed,
                 "accumulation_steps": args.accumulation_steps,
                 "checkpoint.grace_seconds": 20.0}
    if args.strategy == "mirrored":
        overrides["mirrored.cpu_replicas"] = 2
    if args.timeout is not None:
        overrides[f"{args.strategy}.timeout_seconds"] = args.timeout
    if args.scale_learning_rate:
        overrides["horovod.scale_learning_rate"] = True
    runner = tfdist.Runner(tfdist.load_config(overrides=overrides))
    RecordingModel.enabled = args.strategy != "parameter_server"
    task = task_name(runner)
    attempt = sum(name.startswith(f"steps-{task}-") for name in os.listdir(args.out_dir))
    open(os.path.join(args.out_dir, f"steps-{task}-{attempt}.jsonl"), "a").close()
    if args.sigterm_in_trace == task:
        RecordingModel.sigterm_in_trace = (args.out_dir, f"sigterm_in_trace-{task}")
    if args.kill_in_save and args.kill_in_save.split("@")[0] == task:
        kill_inside_save(args.out_dir, task, int(args.kill_in_save.split("@")[1]))

    features, labels = examples()
    source = tf.data.Dataset.from_tensor_slices((features, labels))
    if args.user_shuffle:
        source = source.shuffle(EXAMPLES, seed=None if args.user_shuffle == "unseeded"
                                else int(args.user_shuffle))
    validation = None
    if args.validation:
        held_out = examples(seed=1, count=VALIDATION_EXAMPLES)
        validation = runner.dataset(tf.data.Dataset.from_tensor_slices(held_out), GLOBAL_BATCH,
                                    drop_remainder=False)
    with runner.scope():
        model = make_model()
        model.compile(runner.optimizer(keras.optimizers.Adam(0.01)),
                      "sparse_categorical_crossentropy", metrics=["accuracy"],
                      steps_per_execution=args.steps_per_execution)
    faults = {"kill": fault_points(args.kill), "sigterm": fault_points(args.sigterm),
              "stall": fault_points(args.stall_at)}
    recorder = StepRecorder(os.path.join(args.out_dir, f"steps-{task}-{attempt}.jsonl"))
    sizes = []

    def train():
        # Made anew at each (elastic) start, for the ranks there are now.
        data = runner.dataset(source, GLOBAL_BATCH // args.accumulation_steps,
                              shuffle_buffer_size=0 if args.user_shuffle else EXAMPLES)
        if args.keras_backup:
            callbacks = [keras.callbacks.BackupAndRestore(args.checkpoint_dir,
                                                          save_freq=args.save_every,
                                                          delete_checkpoint=False),
                         *runner.callbacks()]
        else:
            callbacks = runner.callbacks(checkpoint_dir=args.checkpoint_dir,
                                         save_every_steps=args.save_every)
        sizes.append({"replicas": runner.num_replicas,
                      "learning_rate": float(np.asarray(model.optimizer.learning_rate))})
        try:
            return model.fit(data, epochs=args.epochs, verbose=0, validation_data=validation,
                             callbacks=[recorder, *callbacks,
                                        Faults(args.out_dir, task, faults,
                                               args.sigterm_in_validation)])
        except Exception as error:
            with open(os.path.join(args.out_dir, f"error-{task}.json"), "w") as stream:
                json.dump({"at": time.time(), "type": type(error).__name__,
                           "message": str(error)}, stream)
            raise

    history = runner.run_elastic(train) if args.elastic else train()
    report = {"task": task, "attempt": attempt, "starts": sizes,
              "iterations_at_start": recorder.iterations_at_start,
              "iterations": int(model.optimizer.iterations.numpy()),
              "history": {key: [float(v) for v in values]
                          for key, values in history.history.items()}}
    with open(os.path.join(args.out_dir, f"final-{task}.json"), "w") as stream:
        json.dump(report, stream)
    if runner.is_chief:
        np.savez(os.path.join(args.out_dir, "weights.npz"), *model.get_weights())


def bare_multi_worker(args):
    """Plain MultiWorkerMirroredStrategy + model.fit with TensorFlow's defaults (no timeout).

    Keras 3 needs tfdist's two multi-worker fixes to train at all, so they are applied;
    nothing else of tfdist is used.
    """
    from tfdist import patches

    tf.config.threading.set_inter_op_parallelism_threads(4)
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    patches.apply(patches.MULTI_WORKER)
    task = f"worker{strategy.cluster_resolver.task_id}"
    features, labels = examples()
    data = tf.data.Dataset.from_tensor_slices((features, labels)).batch(GLOBAL_BATCH,
                                                                        drop_remainder=True)
    with strategy.scope():
        model = make_model()
        model.compile(keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy")
    model.fit(data, epochs=args.epochs, verbose=0,
              callbacks=[StepRecorder(os.path.join(args.out_dir, f"steps-{task}-0.jsonl")),
                         Faults(args.out_dir, task, {"stall": fault_points(args.stall_at)})])
    with open(os.path.join(args.out_dir, f"final-{task}.json"), "w") as stream:
        json.dump({"task": task}, stream)


if __name__ == "__main__":
    main()
