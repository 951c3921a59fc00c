"""A task of a local cluster that holds its servers up until a test has probed them.

Run by tests/test_network_isolation.py under `tfdist launch`:

    tfdist launch -n 2 [--ps 1] [--network host] -- \
        python tests/scripts/listening_task.py OUT_DIR --strategy multi_worker|parameter_server

Every task writes OUT_DIR/<type>-<index>.pid first. The Runner then starts the task's
TensorFlow server (workers and parameter servers of a parameter_server cluster serve
there until the end). The chief (worker 0 without parameter servers) writes
OUT_DIR/ready, waits for OUT_DIR/probed, trains one epoch and writes OUT_DIR/result.json
(the loss).
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

PROBE_BOUND_SECONDS = 120  # a hang bound: the test probes within seconds


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--strategy", required=True)
    args = parser.parse_args()
    task = json.loads(os.environ["TF_CONFIG"])["task"]
    with open(os.path.join(args.out, f"{task['type']}-{task['index']}.pid"), "w") as file:
        file.write(str(os.getpid()))

    import keras
    import numpy as np
    import tensorflow as tf

    import tfdist

    runner = tfdist.Runner(tfdist.load_config(overrides={"strategy": args.strategy, "seed": 0}))
    if runner.is_chief:
        open(os.path.join(args.out, "ready"), "w").close()
        deadline = time.monotonic() + PROBE_BOUND_SECONDS
        while not os.path.exists(os.path.join(args.out, "probed")):
            if time.monotonic() > deadline:
                raise TimeoutError("no probe came")
            time.sleep(0.1)
    rng = np.random.default_rng(0)
    features = rng.standard_normal((64, 4)).astype("float32")
    targets = features.sum(axis=1, keepdims=True)
    data = runner.dataset(tf.data.Dataset.from_tensor_slices((features, targets)),
                          global_batch_size=16)
    with runner.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.set_weights([np.ones((4, 1), "float32") * 0.1, np.zeros((1,), "float32")])
        model.compile(runner.optimizer(keras.optimizers.SGD(0.1)), "mse")
    history = model.fit(data, epochs=1, verbose=0)
    if runner.is_chief:
        with open(os.path.join(args.out, "result.json"), "w") as file:
            json.dump({"loss": history.history["loss"][-1]}, file)


if __name__ == "__main__":
    main()
