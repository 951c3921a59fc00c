"""Horovod's TensorFlow collectives on each rank: eager allreduce, grouped allreduce in a
tf.function, broadcast. Each rank writes one line to OUT_DIR/rank{R}.txt for the test.

    mpirun -np 2 python tests/scripts/horovod_collectives.py OUT_DIR
"""

import os
import sys

import horovod.tensorflow as hvd
import tensorflow as tf

hvd.init()
rank = hvd.rank()
summed = hvd.allreduce(tf.fill([4], float(rank + 1)), op=hvd.Sum)


@tf.function
def grouped():
    return hvd.grouped_allreduce([tf.fill([3], float(rank)), tf.fill([2, 2], 2.0 * rank)],
                                 op=hvd.Average)


first, second = grouped()
broadcast = hvd.broadcast(tf.constant([float(rank + 10)]), root_rank=0)


def compact(values):
    return str(values).replace(" ", "")


with open(os.path.join(sys.argv[1], f"rank{rank}.txt"), "w") as report:
    report.write(f"rank={rank} size={hvd.size()} sum={compact(summed.numpy().tolist())} "
                 f"average={compact(first.numpy().tolist())}/"
                 f"{compact(second.numpy().ravel().tolist())} "
                 f"broadcast={compact(broadcast.numpy().tolist())}")
