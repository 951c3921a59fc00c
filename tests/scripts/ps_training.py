"""Trains a fixed model on fixed data under parameter_server (or one_device); the chief reports.

Run by tests under `tfdist launch -n W --ps P` (every task runs it; the Runner serves on
workers and parameter servers), or alone with --strategy one_device for the reference:

    tfdist launch -n 2 --ps 1 -- python tests/scripts/ps_training.py OUT.json \
        [--steps_per_execution 1,10] [--sgd_twin] [--epochs E] [--model mlp|embedding] \
        [--set KEY=VALUE ...] [--kill worker:1|ps:0 --pid_dir DIR] [--bare fit|loop [--fixes]]

Each value of --steps_per_execution trains a fresh model from the same start. The chief
writes OUT.json: per run the optimizer's iterations and the steps expected, History,
the epochs callbacks saw, evaluate and predict results and the weights; and the devices
of each variable's shards. Adam with a decaying learning rate makes the weights depend on
every value `optimizer.iterations` takes; --sgd_twin adds a run of SGD with momentum.

--kill TASK: at step 5 of epoch 2 the chief sends SIGKILL to TASK (each task writes its
pid to --pid_dir first). --bare fit: Keras's own model.fit under the strategy (tfdist's
routing removed). --bare loop: no tfdist at all, a hand-written ClusterCoordinator loop;
--fixes applies tfdist's Keras fixes to that loop.
"""

import argparse
import json
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import yaml  # noqa: E402

from tests import reference  # noqa: E402

EXAMPLES, BATCH = 640, 32  # 20 steps per epoch
KILL_AT_STEP = 5


def examples(model_kind):
    return reference.examples(EXAMPLES, embedding=model_kind == "embedding")


def make_model(model_kind):
    return reference.make_model(hidden=64, embedding=model_kind == "embedding")


def initial_weights(model_kind):
    return reference.initial_weights(hidden=64, embedding=model_kind == "embedding")


def make_optimizer(name="adam"):
    """Adam with a decaying rate; "sgd": SGD with momentum, unclipped, at a decaying rate
    too (its step follows the gradient's scale, which Adam's barely does)."""
    if name == "sgd":
        return keras.optimizers.SGD(keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.8),
                                    momentum=0.9)
    return keras.optimizers.Adam(keras.optimizers.schedules.ExponentialDecay(0.01, 10, 0.8))


class EpochRecorder(keras.callbacks.Callback):
    """Records the epochs callbacks see, and kills a task mid-epoch when asked."""

    def __init__(self, kill=None, pid_dir=None):
        super().__init__()
        self.epochs, self.kill, self.pid_dir, self.epoch = [], kill, pid_dir, 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if self.kill and self.epoch == 1 and batch == KILL_AT_STEP:
            task_type, index = self.kill.split(":")
            with open(os.path.join(self.pid_dir, f"{task_type}-{index}.pid")) as file:
                os.kill(int(file.read()), signal.SIGKILL)
            print(f"killed {self.kill}", flush=True)
            self.kill = None

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append(epoch)


def shard_devices(model):
    devices = {}
    for weight in model.weights:
        value = getattr(weight, "_value", weight)
        shards = getattr(value, "variables", None)
        devices[weight.path] = [s.device for s in shards] if shards else [value.device]
    return devices


def train_with_runner(args, spe_values, report):
    import tfdist

    overrides = {"strategy": args.strategy, "precision": "float32", "seed": 0}
    overrides.update((key, yaml.safe_load(value)) for key, value in
                     (setting.split("=", 1) for setting in args.set))
    runner = tfdist.Runner(tfdist.load_config(overrides=overrides))  # Serves on workers, ps.
    if args.bare == "fit":
        from tfdist.patches import keras_trainer

        for patch in (keras_trainer.PARAMETER_SERVER_FIT, keras_trainer.PARAMETER_SERVER_EVALUATE,
                      keras_trainer.PARAMETER_SERVER_PREDICT):
            patch.undo()
    features, labels = examples(args.model)
    metrics = ["accuracy"]
    if args.labels_by_batch:
        # Batch i's examples all have label i % 2, and a metric averages the labels each
        # epoch trained on: 0 or 1 when every step read batches of one parity only (one
        # worker's shard, read by all), between when the workers read their own shards.
        labels = ((np.arange(EXAMPLES) // BATCH) % 2).astype(labels.dtype)

        def label_mean(y_true, y_pred):
            return tf.reduce_mean(tf.cast(y_true, "float32"))

        metrics.append(label_mean)
    train = runner.dataset(tf.data.Dataset.from_tensor_slices((features, labels)), BATCH)
    test = runner.dataset(tf.data.Dataset.from_tensor_slices((features[:100], labels[:100])),
                          BATCH, drop_remainder=False)
    start = initial_weights(args.model)
    runs = [(spe, "adam") for spe in spe_values] + ([(1, "sgd")] if args.sgd_twin else [])
    for spe, optimizer_name in runs:
        with runner.scope():
            model = make_model(args.model)
            model.set_weights(start)
            model.compile(runner.optimizer(make_optimizer(optimizer_name)),
                          "sparse_categorical_crossentropy",
                          metrics=metrics, steps_per_execution=spe)
        recorder = EpochRecorder(args.kill, args.pid_dir)
        # Positional, as Keras's signature orders them: x, y, batch_size, epochs, verbose,
        # callbacks (the routed fit binds them by name).
        history = model.fit(train, None, None, args.epochs, 0, [recorder],
                            validation_data=test)
        predictions = model.predict(test, verbose=0)
        report["runs"].append({
            "steps_per_execution": spe, "optimizer": optimizer_name,
            "policy": model.get_layer("hidden").dtype_policy.name,
            "iterations": int(model.optimizer.iterations.numpy()),
            "expected": args.epochs * EXAMPLES // BATCH,
            "learning_rate": float(model.optimizer.learning_rate.numpy()),
            "history": {k: [float(v) for v in values] for k, values in history.history.items()},
            "epochs_seen": recorder.epochs,
            "evaluate": [float(v) for v in model.evaluate(test, verbose=0)],
            "predict_shape": list(predictions.shape),
            "predict_sum": float(predictions.sum()),
            "weights": [w.tolist() for w in model.get_weights()],
        })
        report["shards"] = shard_devices(model)
    report["stateless_call_writes_variables"] = stateless_call_writes_variables()
    return runner.is_chief


class Counter(keras.layers.Layer):
    """Counts its calls in a non-trainable variable, with `assign_add`."""

    def build(self, input_shape):
        self.calls = self.add_weight(shape=(), initializer="zeros", trainable=False)

    def call(self, inputs):
        self.calls.assign_add(1.0)
        return inputs


def stateless_call_writes_variables():
    """After parameter-server training in this process (its patches applied), whether
    `stateless_call` of a plain layer writes the layer's variables (it must not)."""
    layer = Counter()
    layer(np.ones((1, 2), "float32"))
    layer.stateless_call([], [v.value for v in layer.non_trainable_variables],
                         np.ones((1, 2), "float32"))
    return float(layer.calls.numpy()) != 1.0


def train_bare_loop(args, report):
    """A hand-written coordinator loop, as the TensorFlow guide writes it; no tfdist."""
    tf_config = json.loads(os.environ["TF_CONFIG"])
    cluster = tf.train.ClusterSpec(tf_config["cluster"])
    task_type, index = tf_config["task"]["type"], tf_config["task"]["index"]
    threads = len(tf_config["cluster"]["worker"]) + 1
    if task_type != "chief":
        config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=threads)
        tf.distribute.Server(cluster, job_name=task_type, task_index=index, config=config,
                             protocol="grpc").join()
    tf.config.threading.set_inter_op_parallelism_threads(threads)
    if args.fixes:
        from tfdist import patches

        patches.apply(patches.PARAMETER_SERVER)
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        cluster, task_type=task_type, task_id=index, rpc_layer="grpc")
    strategy = tf.distribute.ParameterServerStrategy(resolver)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    start = initial_weights(args.model)
    with strategy.scope():
        model = make_model(args.model)
        model.set_weights(start)
        model.compile(make_optimizer(), "sparse_categorical_crossentropy")
    features, labels = examples(args.model)

    def dataset_fn():
        return tf.data.Dataset.from_tensor_slices((features, labels)).repeat().batch(BATCH)

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

    @tf.function
    def step(iterator):
        strategy.run(model.train_step, args=(next(iterator),))

    steps = args.epochs * EXAMPLES // BATCH
    for _ in range(steps):
        coordinator.schedule(step, args=(iterator,))
    coordinator.join()
    report["runs"].append({"iterations": int(model.optimizer.iterations.numpy()),
                           "expected": steps})
    return True


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--strategy", default="parameter_server")
    parser.add_argument("--steps_per_execution", default="1")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--model", choices=["mlp", "embedding"], default="mlp")
    parser.add_argument("--set", action="append", default=[], help="KEY=VALUE config override")
    parser.add_argument("--kill", help="worker:1 or ps:0")
    parser.add_argument("--pid_dir")
    parser.add_argument("--bare", choices=["fit", "loop"])
    parser.add_argument("--fixes", action="store_true")
    parser.add_argument("--labels_by_batch", action="store_true",
                        help="label each batch by its parity; report the mean label trained on")
    parser.add_argument("--sgd_twin", action="store_true",
                        help="after the other runs, one more with SGD (momentum 0.9)")
    args = parser.parse_args()

    if args.pid_dir:
        task = json.loads(os.environ["TF_CONFIG"])["task"]
        with open(os.path.join(args.pid_dir, f"{task['type']}-{task['index']}.pid"), "w") as f:
            f.write(str(os.getpid()))
    report = {"runs": [], "shards": {}}
    if args.bare == "loop":
        is_chief = train_bare_loop(args, report)
    else:
        spe_values = [int(value) for value in args.steps_per_execution.split(",")]
        is_chief = train_with_runner(args, spe_values, report)
    if is_chief:
        with open(args.out, "w") as file:
            json.dump(report, file)
        print("iterations=" + ",".join(str(run["iterations"]) for run in report["runs"]),
              flush=True)


if __name__ == "__main__":
    main()
