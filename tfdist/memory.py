"""A process's memory as TensorFlow's own allocator counts it: the bytes alive, and the peak.

On a GPU the allocator always counts. On a CPU it counts once `TF_CPU_ALLOCATOR_USE_BFC=true`
is in the environment before TensorFlow starts (the host then uses the BFC allocator, as a
GPU does); otherwise TensorFlow has no figures for the CPU and these functions say None.
The allocator's figures are exact bytes of tensors and variables. Resident memory (RSS)
is not: it includes glibc's arenas and freed memory not yet returned, and two ranks of one
run differ by hundreds of MB, so it is a poor measure of what sharding saves.

Example:

    peak = PeakMemory()
    model.fit(dataset, epochs=2, callbacks=[peak])
    peak.bytes   # {"CPU:0": AllocatorPeak(before_fit=..., fit=...)}, or None on a plain CPU
"""

from __future__ import annotations

import dataclasses
from typing import Any

import keras
import tensorflow as tf

from tfdist.cluster import cpu_allocator_counts


@dataclasses.dataclass(frozen=True)
class AllocatorBytes:
    """One device's allocator figures, in bytes."""

    current: int  # alive now
    peak: int  # the most alive at once since the process started, or since `reset_peak`


@dataclasses.dataclass(frozen=True)
class AllocatorPeak:
    """The most bytes one device's allocator held at once."""

    before_fit: int  # from the process's start to `fit`'s (the model's build, the data)
    fit: int  # during `fit` alone

    @property
    def process(self) -> int:
        """From the process's start to the end of `fit`."""
        return max(self.before_fit, self.fit)


def counted_devices() -> list[str]:
    """The devices whose allocators hold this process's tensors: each visible GPU, or
    the host ("CPU:0"; every logical CPU device shares the host's one allocator)."""
    gpus = tf.config.list_logical_devices("GPU")
    return [device.name.split("device:")[-1] for device in gpus] if gpus else ["CPU:0"]


def allocator_bytes(device: str = "CPU:0") -> AllocatorBytes | None:
    """The allocator's figures for `device`, or None where it keeps none (a CPU without
    `TF_CPU_ALLOCATOR_USE_BFC=true` set before TensorFlow started).

    Args:
        device: A local device, such as "CPU:0" or "GPU:1".

    Example:
        allocator_bytes("CPU:0")   # AllocatorBytes(current=4194304, peak=4194560)
    """
    if "CPU" in device.upper() and not cpu_allocator_counts():
        # The plain CPU allocator counts nothing, whatever it answers (zeros, on some CPUs).
        return None
    try:
        info = tf.config.experimental.get_memory_info(device)
    except ValueError:  # "Allocator stats not available for device"
        return None
    return AllocatorBytes(current=int(info["current"]), peak=int(info["peak"]))


def reset_peak(device: str = "CPU:0") -> None:
    """Starts `device`'s peak again from the bytes alive now (no-op where none is kept).

    Args:
        device: A local device, such as "CPU:0" or "GPU:1".
    """
    if allocator_bytes(device) is not None:
        tf.config.experimental.reset_memory_stats(device)


class PeakMemory(keras.callbacks.Callback):
    """The allocator's peak of each counted device: over the process up to the end of
    `fit`, and during `fit` alone.

    At the start of `fit` it reads the peak so far (the model's build, the data's first
    tensors) and starts a new one; at the end it reads the new one. A later `fit` with
    the same callback measures that `fit`, and the process's peak up to its end.

    Example:

        peak = PeakMemory()
        model.fit(dataset, epochs=2, callbacks=[peak])
        peak.bytes["CPU:0"].fit   # bytes, with TF_CPU_ALLOCATOR_USE_BFC=true on a CPU
    """

    def __init__(self):
        super().__init__()
        self._before: dict[str, int] = {}
        self.bytes: dict[str, AllocatorPeak] | None = None  # None: no allocator counts

    def on_train_begin(self, logs: Any = None) -> None:
        self._before = {}
        for device in counted_devices():
            figures = allocator_bytes(device)
            if figures is not None:
                self._before[device] = figures.peak
                reset_peak(device)

    def on_train_end(self, logs: Any = None) -> None:
        self.bytes = {device: AllocatorPeak(before_fit=before,
                                            fit=allocator_bytes(device).peak)
                      for device, before in self._before.items()} or None

    def to_dict(self) -> dict[str, dict[str, int]] | None:
        """`bytes` as plain JSON: {device: {"process", "before_fit", "fit"}}, or None."""
        return None if self.bytes is None else {
            device: {"process": peak.process, "before_fit": peak.before_fit, "fit": peak.fit}
            for device, peak in self.bytes.items()}
