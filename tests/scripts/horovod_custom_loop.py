"""A custom training loop as Horovod's docs write one: `opt._compute_gradients`, then
`opt.apply_gradients`, in a `tf.function`, on every rank under mpirun.

    mpirun -np 2 python tests/scripts/horovod_custom_loop.py OUT_DIR --op Sum|Average

Rank r's loss is sum((r + 1) * w), so its gradient is r + 1 in every element; SGD(0.1)
takes one step from w = [1, 2]. Each rank writes OUT_DIR/rank<R>.json: the gradient
`_compute_gradients` returned and w after the step.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--op", default="Average")
    args = parser.parse_args()

    import keras
    import tensorflow as tf

    import tfdist.horovod.keras as hvd

    hvd.init()
    w = keras.Variable([1.0, 2.0])
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), op=getattr(hvd, args.op))
    factor = float(hvd.rank() + 1)

    @tf.function
    def step():
        grads_and_vars = opt._compute_gradients(lambda: tf.reduce_sum(w.value * factor),
                                                var_list=[w])
        opt.apply_gradients(grads_and_vars)
        return grads_and_vars[0][0]

    gradient = step()
    with open(os.path.join(args.out_dir, f"rank{hvd.rank()}.json"), "w") as stream:
        json.dump({"gradient": gradient.numpy().tolist(), "w": w.numpy().tolist()}, stream)


if __name__ == "__main__":
    main()
