"""The ring all-reduce cost model that sync_cost.py validates and projection.py extrapolates.

    T = 2(N-1)/N x S / B(S) + 2(N-1) x a  +  c x S / P  +  (n - 1) x t

for S bytes in n tensors on N replicas: the textbook ring (bandwidth B, latency a
per step), what a list of tensors adds beyond one tensor of the same bytes (a copy
of its pack at rate P where the implementation makes one, c = 1; t per tensor),
and a bandwidth that falls once at a fitted message size.

    from ring_model import fit_ring_model, pack_is_copied

    model = fit_ring_model(runs)  # (bytes, tensors, copied, seconds) per calibration run
    model.seconds(100 * 2**20, tensors=8, copied=pack_is_copied("horovod", sizes))
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

REPLICAS = 2

# TensorFlow's SplitV returns slices of its input, not copies, only when every piece
# starts and ends on Eigen's alignment: 64 bytes in the TensorFlow 2.21 x86 build
# (measured: 16 float32 elements share the buffer, 8 do not).
TF_ALIGNMENT_BYTES = 64


def pack_is_copied(strategy_name: str, elements: list[int]) -> bool:
    """Whether reducing tensors of these sizes copies their bytes beyond one tensor's.

    Horovod copies every fused tensor into its fusion buffer and out. TensorFlow's
    collectives concatenate a list into one pack and split the result; the split
    shares the pack's buffer unless a tensor's bytes are not a multiple of the
    alignment, and then copies all of it (tensorflow/core/kernels/split_v_op.cc,
    SplitHasAlignedOutputsInFirstDimension), so one 10-element bias costs a copy
    of every gradient.

    Args:
        strategy_name: "mirrored" or "multi_worker" (TensorFlow's collectives), "horovod".
        elements: Each float32 tensor's number of elements, in order.

    Example:
        pack_is_copied("multi_worker", [1024 * 1024, 1024, 1024 * 10, 10])  # True: the 10
    """
    if len(elements) < 2:
        return False
    if strategy_name == "horovod":
        return True
    return any(count * 4 % TF_ALIGNMENT_BYTES for count in elements)


@dataclasses.dataclass(frozen=True)
class RingModel:
    """The ring all-reduce's cost, with what a list of tensors adds and a link whose
    bandwidth changes once with the message's size.

        T = 2(N-1)/N x S / B(S) + 2(N-1) x a  +  c x S / P  +  (n - 1) x t

    for S bytes in n tensors on N replicas. The first two terms are the textbook
    ring's. A list is reduced as one buffer: TensorFlow's collectives concatenate it
    into one pack and split the result, Horovod fuses it in its fusion buffer. Where
    that copies the bytes once more (c = 1, see `pack_is_copied`) it costs S / P; each
    tensor beyond the first costs t (an op, a slot in the pack).

    Between processes on one machine the link is the memory system and the
    transport's own buffers, and its bandwidth falls once a message outgrows them:
    B(S) = B_small for S <= S_switch, else B_large. Where that happens is fitted,
    not assumed: for MPI's shared memory it is near the last-level cache, for
    TensorFlow's gRPC well beyond it.

    Attributes:
        bandwidth_small: B for messages up to `switch_bytes` (bytes/s).
        bandwidth_large: B for larger ones (bytes/s).
        switch_bytes: S_switch (inf: one bandwidth).
        latency: a, per step of the ring (s); with N = 2 it also holds the call's fixed cost.
        pack_bandwidth: P, the rate of the pack's extra copy (bytes/s; inf: none measured).
        per_tensor: t (s).

    Example:
        model = fit_ring_model([(2**20, 1, False, 0.0012), (2**26, 1, False, 0.031), ...])
        model.seconds(10 * 2**20, tensors=8, copied=True)  # 10 MB of gradients in 8 tensors
    """

    bandwidth_small: float
    bandwidth_large: float
    switch_bytes: float
    latency: float
    pack_bandwidth: float
    per_tensor: float

    def seconds(self, size_bytes: float, tensors: int = 1, copied: bool | None = None,
                replicas: int = REPLICAS) -> float:
        """T for S bytes in n tensors on N replicas.

        Args:
            size_bytes: S.
            tensors: n.
            copied: Whether the list's pack is copied once more (c); None: whenever
                n > 1, as in Horovod's fusion buffer.
            replicas: N.
        """
        copied = tensors > 1 if copied is None else copied
        bandwidth = (self.bandwidth_small if size_bytes <= self.switch_bytes
                     else self.bandwidth_large)
        return (ring_seconds(size_bytes, bandwidth, self.latency, replicas)
                + (size_bytes / self.pack_bandwidth if copied else 0.0)
                + (tensors - 1) * self.per_tensor)


def ring_seconds(size_bytes: float, bandwidth: float, latency: float,
                 replicas: int = REPLICAS) -> float:
    """The ring all-reduce's time: 2(N-1)/N x S / B + 2(N-1) x a."""
    return 2 * (replicas - 1) / replicas * size_bytes / bandwidth + 2 * (replicas - 1) * latency


def fit_ring_model(runs: list[tuple[float, int, bool, float]],
                   replicas: int = REPLICAS) -> RingModel:
    """Fits the RingModel to calibration runs.

    For a given S_switch the model is linear in 1/B_small, 1/B_large, a, 1/P and t:
    least squares on relative error, dividing each row by its measured time, so the
    small runs (where latency shows) count as much as the large ones. S_switch is
    tried between every two neighbouring sizes (at their geometric mean; sizes
    within 10% count as one) that leave at least two sizes on each side, and not at
    all (one bandwidth); of those where the bandwidth falls at the switch, the one
    with the least squared error is kept. A term no run exercises (no copied pack,
    no list) is zero, as is one the data cannot tell from zero.

    Args:
        runs: (S bytes, n tensors, whether the pack is copied, median seconds) per run.
        replicas: N.

    Returns:
        The fitted RingModel.

    Example:
        fit_ring_model([(4.0 * sum(sizes), len(sizes), pack_is_copied("horovod", sizes),
                         statistics.median(seconds)) for sizes, seconds in calibration])
    """
    sizes, counts, copied, times = (np.array(column, dtype=np.float64)
                                    for column in zip(*runs))
    distinct = []  # sizes 10% or more apart: a list of 64 MB and a bias is 64 MB here
    for size in sorted(set(sizes)):
        if not distinct or size > 1.1 * distinct[-1]:
            distinct.append(size)
    switches = [math.inf] + [math.sqrt(low * high) for low, high in
                             zip(distinct[1:-2], distinct[2:-1])]
    steps = 2 * (replicas - 1)
    best = None
    for switch in switches:
        small = sizes <= switch
        columns = [steps / replicas * sizes * small, steps / replicas * sizes * ~small,
                   steps * np.ones_like(sizes), sizes * copied, counts - 1]
        used = [bool(column.any()) for column in columns]
        design = np.stack([column for column, use in zip(columns, used) if use], axis=1)
        weighted = design / times[:, None]
        solution = np.linalg.lstsq(weighted, np.ones_like(times), rcond=None)[0]
        error = float(np.sum((weighted @ solution - 1) ** 2))
        # The bandwidth falls at the switch; a "rise" would be latency mistaken for bytes.
        falls = switch == math.inf or 0 < solution[0] <= solution[1]
        if falls and (best is None or error < best[0]):
            values = iter(solution)
            best = (error, switch, [float(next(values)) if use else 0.0 for use in used])
    _, switch, (inverse_small, inverse_large, latency, inverse_pack, per_tensor) = best
    if switch == math.inf:
        inverse_large = inverse_small
    return RingModel(bandwidth_small=1 / inverse_small, bandwidth_large=1 / inverse_large,
                     switch_bytes=switch, latency=max(latency, 0.0),
                     pack_bandwidth=1 / inverse_pack if inverse_pack > 0 else math.inf,
                     per_tensor=max(per_tensor, 0.0))


def predict(model: RingModel, strategy_name: str, elements: list[int]) -> float:
    """The model's seconds for reducing float32 tensors of these sizes under the strategy.

    Args:
        model: A fitted RingModel.
        strategy_name: Whose reduction ("mirrored", "multi_worker", "horovod").
        elements: Each tensor's number of elements.
    """
    return model.seconds(4.0 * sum(elements), len(elements),
                         pack_is_copied(strategy_name, elements))
