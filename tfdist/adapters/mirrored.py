"""`mirrored`: synchronous data parallelism over the devices of one machine.

`mirrored.cpu_replicas: N` splits the CPU into N logical devices, so a machine
without GPUs runs N replicas: the same code path as N GPUs, for tests and demos.

Example:

    config = tfdist.load_config(overrides={"strategy": "mirrored",
                                           "mirrored.cpu_replicas": 2})
    tfdist.Runner(config).num_replicas   # 2
"""

from __future__ import annotations

import itertools
import threading

import tensorflow as tf

from tfdist.adapters.base import Adapter, check_device
from tfdist.config import CrossDeviceOps
from tfdist.devices import split_cpu
from tfdist.errors import ConfigError


class MirroredAdapter(Adapter):
    """`tf.distribute.MirroredStrategy` over configured, detected or logical CPU devices."""

    def create_strategy(self) -> tf.distribute.Strategy:
        options = self.config.mirrored
        if options.cpu_replicas:
            devices = split_cpu(options.cpu_replicas, key="mirrored.cpu_replicas")
        elif options.devices:
            devices = [check_device(d, self.cluster, "mirrored.devices") for d in options.devices]
        else:
            devices = None  # TensorFlow's choice: every GPU, else the CPU.
        return new_mirrored_strategy(devices, self._cross_device_ops())

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


# Every MirroredStrategy numbers its collective groups from 1 and their instances
# from 100. A second strategy in the same process (a notebook, a sweep, a second
# Runner) reuses the first one's keys, and once the tensors differ the runtime's
# cached collectives fail with "Shape mismatch in the collective instance 100"
# (tensorflow/tensorflow#62790). TensorFlow's own tests give each strategy a key
# base through the class attribute `_collective_key_base`, read once when the
# strategy is built; tfdist does the same, so each strategy has keys of its own.
_GROUP_KEYS_PER_STRATEGY = 10_000
_strategy_serial = itertools.count(1)
_key_base_lock = threading.Lock()


def new_mirrored_strategy(devices: list[str] | None,
                          cross_device_ops: tf.distribute.CrossDeviceOps | None
                          ) -> tf.distribute.MirroredStrategy:
    """A `MirroredStrategy` whose collective keys no other strategy in the process uses.

    Args:
        devices: Device names, or None for TensorFlow's choice.
        cross_device_ops: The all-reduce implementation, or None for TensorFlow's choice.
    """
    strategy_cls = tf.distribute.MirroredStrategy
    with _key_base_lock:
        previous = strategy_cls._collective_key_base
        strategy_cls._collective_key_base = next(_strategy_serial) * _GROUP_KEYS_PER_STRATEGY
        try:
            return strategy_cls(devices=devices, cross_device_ops=cross_device_ops)
        finally:
            strategy_cls._collective_key_base = previous
