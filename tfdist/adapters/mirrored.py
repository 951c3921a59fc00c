"""`mirrored`: synchronous data parallelism over the devices of one machine.

`mirrored.cpu_replicas: N` splits the CPU into N logical devices, so a machine
without GPUs runs N replicas: the same code path as N GPUs, for tests and demos.

Example:

    config = tfdist.load_config(overrides={"strategy": "mirrored",
                                           "mirrored.cpu_replicas": 2})
    tfdist.Runner(config).num_replicas   # 2
"""

from __future__ import annotations

import tensorflow as tf

from tfdist.adapters.base import Adapter, check_device
from tfdist.config import CrossDeviceOps
from tfdist.devices import split_cpu
from tfdist.errors import ConfigError
from tfdist.patches import tensorflow_distribute


class MirroredAdapter(Adapter):
    """`tf.distribute.MirroredStrategy` over configured, detected or logical CPU devices."""

    zero_refusal = ("Keras's optimizer under tf.distribute creates each slot as one mirrored "
                    "variable and updates it in one cross-replica step, the same on every "
                    "replica, so no replica can hold a partition of its own; shard with one "
                    "process per device: strategy horovod (mpirun -np N ... --strategy "
                    "horovod)")

    single_process = True

    patches_while_building = (tensorflow_distribute.MIRRORED_COLLECTIVE_KEYS,)

    def create_strategy(self) -> tf.distribute.Strategy:
        options = self.config.mirrored
        if options.cpu_replicas:
            devices = split_cpu(options.cpu_replicas, key="mirrored.cpu_replicas")
        elif options.devices:
            devices = [check_device(d, self.cluster, "mirrored.devices") for d in options.devices]
        else:
            devices = None  # TensorFlow's choice: every GPU, else the CPU.
        # Keys of its own, so a second strategy in this process does not collide with
        # the first (tensorflow/tensorflow#62790).
        with tensorflow_distribute.MIRRORED_COLLECTIVE_KEYS.applied():
            return tf.distribute.MirroredStrategy(devices=devices,
                                                  cross_device_ops=self._cross_device_ops())

    def _cross_device_ops(self) -> tf.distribute.CrossDeviceOps | None:
        choice = self.config.mirrored.cross_device_ops
        if choice is CrossDeviceOps.NCCL:
            if not self.cluster.gpus:
                raise ConfigError("mirrored.cross_device_ops=nccl needs GPUs and this machine "
                                  "has none; use auto or reduce_to_one. "
                                  "Received: mirrored.cross_device_ops=nccl")
            return tf.distribute.NcclAllReduce()
        if choice is CrossDeviceOps.HIERARCHICAL_COPY:
            return tf.distribute.HierarchicalCopyAllReduce()
        if choice is CrossDeviceOps.REDUCE_TO_ONE:
            return tf.distribute.ReductionToOneDevice()
        return None
