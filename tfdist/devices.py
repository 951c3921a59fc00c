"""Logical devices: splitting the CPU so a machine without GPUs has several replicas, or
several devices to spread one model over.

Used by every adapter that offers `cpu_replicas` or `model_parallel.devices`; adapters do
not import each other.

Example:

    split_cpu(2)   # ['/device:CPU:0', '/device:CPU:1']
"""

from __future__ import annotations

import tensorflow as tf

from tfdist.errors import ConfigError


def split_cpu(replicas: int, key: str = "cpu_replicas") -> list[str]:
    """Splits the first CPU into `replicas` logical devices and returns their names.

    TensorFlow fixes its devices when its runtime starts. Before that, the split
    is set here; after it, an existing split with enough devices is reused.

    Args:
        replicas: Logical CPU devices wanted.
        key: The config key that asked for them, for the error message.

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
        raise ConfigError(f"{key}={replicas} needs {replicas} logical CPU devices, but "
                          f"TensorFlow already started with {len(logical)}; create the Runner "
                          f"before any TensorFlow op runs, or use a fresh process. "
                          f"Received: {key}={replicas}")
    return [device.name for device in logical[:replicas]]


def model_devices(count: int, gpus: int) -> tuple[str, ...]:
    """The `count` devices one model is spread over in this process: its first `count`
    visible GPUs, or, with none, `count` logical CPU devices.

    Args:
        count: `model_parallel.devices`.
        gpus: The GPUs this process sees.

    Raises:
        ConfigError: fewer GPUs than `count`.
    """
    if not gpus:
        return tuple(split_cpu(count, "model_parallel.devices"))
    if gpus < count:
        raise ConfigError(f"model_parallel.devices={count} needs {count} GPUs for each "
                          f"process, but it sees {gpus}; lower model_parallel.devices or start "
                          f"fewer processes per machine. Received: model_parallel.devices="
                          f"{count}, {gpus} GPUs")
    return tuple(f"/device:GPU:{index}" for index in range(count))
