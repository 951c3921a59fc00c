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
from tfdist.errors import ConfigError


class MirroredAdapter(Adapter):
    """`tf.distribute.MirroredStrategy` over configured, detected or logical CPU devices."""

    def create_strategy(self) -> tf.distribute.Strategy:
        options = self.config.mirrored
        if options.cpu_replicas:
            devices = split_cpu(options.cpu_replicas)
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


def split_cpu(replicas: int) -> list[str]:
    """Splits the first CPU into `replicas` logical devices and returns their names.

    TensorFlow fixes its devices when its runtime starts. Before that, the split
    is set here; after it, an existing split with enough devices is reused.

    Args:
        replicas: Logical CPU devices wanted.

    Raises:
        ConfigError: TensorFlow already started with fewer CPU devices.
    """
    cpu = tf.config.list_physical_devices("CPU")[0]
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(replicas)])
        # Named without listing them: listing starts the runtime, and a multi-worker
        # strategy must configure its collectives before that.
        return [f"/device:CPU:{index}" for index in range(replicas)]
    except RuntimeError:  # The runtime has started; what it has is what there is.
        pass
    logical = tf.config.list_logical_devices("CPU")
    if len(logical) < replicas:
        raise ConfigError(f"mirrored.cpu_replicas={replicas} needs {replicas} logical CPU "
                          f"devices, but TensorFlow already started with {len(logical)}; create "
                          f"the Runner before any TensorFlow op runs, or use a fresh process. "
                          f"Received: mirrored.cpu_replicas={replicas}")
    return [device.name for device in logical[:replicas]]
