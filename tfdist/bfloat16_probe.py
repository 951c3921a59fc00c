"""Whether bfloat16 matmuls are faster than float32 on this CPU: measured, not assumed.

AVX512_BF16 in the CPU's flags says the instructions exist, not that TensorFlow's
kernels gain from them: `benchmarks/precision.py` measured mixed_bfloat16 at 1.7x of
float32 on an AMD EPYC with AVX512_BF16, and at 0.66x on an Intel Xeon (Sapphire
Rapids, AVX512_BF16, AMX not exposed to the VM), where its bare matmul ran at 159
against 274 GFLOP/s. So `precision: auto` on a CPU with those flags asks this probe:
one square matmul in each dtype, interleaved, medians (about 0.2 s of matmuls). It
runs in a child process, because the Runner decides the precision before TensorFlow
may start in its own process (threads and devices are set first), and its figures
are kept per CPU model, core count and TensorFlow version in the cache folder, so a
machine measures once. Concurrent first runs (the ranks of one machine) measure once:
the others wait on a lock and read the result.

Example:

    probe = cached_probe(detect_cluster())
    probe.float32_gflops, probe.bfloat16_gflops, probe.bfloat16_faster
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

# bfloat16 must beat float32 by this much to be chosen: a mixed_bfloat16 model also
# pays for casts that the bare matmul does not.
MIN_SPEEDUP = 1.1
MATMUL_SIZE = 1024
ROUNDS = 5
CACHE_FILE = "bfloat16_probe.json"


@dataclasses.dataclass(frozen=True)
class MatmulProbe:
    """A probe's figures: median GFLOP/s of a square matmul in float32 and in bfloat16.

    Args:
        float32_gflops: float32's median GFLOP/s.
        bfloat16_gflops: bfloat16's median GFLOP/s.
        seconds: How long the matmuls took in all (warm-up included).
        cached: Read from the cache rather than measured by this call.
    """

    float32_gflops: float
    bfloat16_gflops: float
    seconds: float = 0.0
    cached: bool = False

    @property
    def speedup(self) -> float:
        """bfloat16's GFLOP/s over float32's."""
        return self.bfloat16_gflops / self.float32_gflops

    @property
    def bfloat16_faster(self) -> bool:
        """Whether bfloat16 is faster by at least `MIN_SPEEDUP`."""
        return self.speedup >= MIN_SPEEDUP

    def describe(self) -> str:
        """One line: both figures and the ratio."""
        return (f"bfloat16 matmul {self.bfloat16_gflops:.0f} vs float32 "
                f"{self.float32_gflops:.0f} GFLOP/s ({self.speedup:.2f}x)")


def measure(size: int = MATMUL_SIZE, rounds: int = ROUNDS) -> MatmulProbe:
    """Times `rounds` interleaved pairs of `size` x `size` matmuls after one warm-up each.

    Starts TensorFlow in this process: call it where nothing else is configured yet
    to happen (the child process of `cached_probe`), or after the Runner.
    """
    import tensorflow as tf

    started = time.perf_counter()
    flops = 2.0 * size ** 3
    times: dict[Any, list[float]] = {tf.float32: [], tf.bfloat16: []}
    operands = {dtype: tf.random.stateless_normal((size, size), seed=(1, 2), dtype=tf.float32)
                for dtype in times}
    operands = {dtype: tf.cast(value, dtype) for dtype, value in operands.items()}
    matmul = tf.function(lambda x: tf.matmul(x, x))
    for dtype in times:
        matmul(operands[dtype]).numpy()  # warm-up: trace and first run
    for _ in range(rounds):
        for dtype in times:  # interleaved: both see the same machine load
            start = time.perf_counter()
            matmul(operands[dtype]).numpy()
            times[dtype].append(time.perf_counter() - start)
    return MatmulProbe(float32_gflops=flops / statistics.median(times[tf.float32]) / 1e9,
                       bfloat16_gflops=flops / statistics.median(times[tf.bfloat16]) / 1e9,
                       seconds=time.perf_counter() - started)


def cache_key(cluster: Any) -> str:
    """What the figures depend on: the CPU model, the cores, TensorFlow's version."""
    return (f"{cluster.cpu_model or 'unknown CPU'}|{cluster.cpu_cores} cores|"
            f"tensorflow {_tensorflow_version()}")


def _tensorflow_version() -> str:
    """The installed TensorFlow's version, without importing it (the wheel is named
    tensorflow, tensorflow-cpu, ... by build)."""
    from importlib import metadata

    for name in ("tensorflow", "tensorflow-cpu", "tensorflow-gpu", "tensorflow-intel"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return "unknown"


def cached_probe(cluster: Any) -> MatmulProbe:
    """This machine's figures: from the cache, or measured once in a child process.

    Args:
        cluster: A `tfdist.cluster.ClusterInfo` (the CPU model, cores and cache folder).

    Raises:
        RuntimeError: the child process failed (its last line is in the message) or hung.
        OSError: the cache folder cannot be written.
    """
    if not cluster.cache_dir:
        return MatmulProbe(**_measure_in_child())
    os.makedirs(cluster.cache_dir, exist_ok=True)
    path = os.path.join(cluster.cache_dir, CACHE_FILE)
    key = cache_key(cluster)
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one measurement per machine at a time
        known = _read(path)
        if key in known:
            return MatmulProbe(**known[key], cached=True)
        figures = _measure_in_child()
        known[key] = figures
        temporary = f"{path}.{os.getpid()}.tmp"
        with open(temporary, "w", encoding="utf-8") as stream:
            json.dump(known, stream, indent=1)
        os.replace(temporary, path)  # atomic: a reader sees the old file or the new
        return MatmulProbe(**figures)


def _measure_in_child() -> dict[str, float]:
    try:
        child = subprocess.run([sys.executable, "-m", "tfdist.bfloat16_probe"],
                               capture_output=True, text=True, timeout=300,
                               stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise RuntimeError("the bfloat16 probe did not finish in 300 s") from None
    lines = child.stdout.strip().splitlines()
    if child.returncode != 0 or not lines:
        raise RuntimeError("the bfloat16 probe failed: "
                           + (child.stderr.strip().splitlines() or ["no output"])[-1])
    return json.loads(lines[-1])


def _read(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as stream:
            return json.load(stream)
    except (OSError, ValueError):
        return {}


if __name__ == "__main__":
    result = measure()
    print(json.dumps({"float32_gflops": result.float32_gflops,
                      "bfloat16_gflops": result.bfloat16_gflops, "seconds": result.seconds}))
