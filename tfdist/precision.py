"""Dtype policies: which one a run uses, and applying it to Keras.

`resolve_precision` turns the config's request (a policy, `auto`, or unset)
into a concrete `PrecisionPolicy`, using what cluster detection found. The
policy sets Keras's global dtype policy only while models are being built
(`PrecisionPolicy.applied()`), and wraps optimizers for loss scaling.

Example:

    policy = resolve_precision(Precision.AUTO, strategy=Strategy.MIRRORED, cluster=info)
    with policy.applied():
        model = build_model()            # layers compute in policy.compute_dtype
    optimizer = policy.wrap_optimizer(keras.optimizers.Adam())
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator

from tfdist.cluster import ClusterInfo
from tfdist.config import Precision, Strategy, check_precision_supported

_COMPUTE_DTYPE = {
    Precision.FLOAT32: "float32",
    Precision.MIXED_FLOAT16: "float16",
    Precision.MIXED_BFLOAT16: "bfloat16",
}


@dataclasses.dataclass(frozen=True)
class PrecisionPolicy:
    """A concrete dtype policy (never `auto`) and why it was chosen.

    Args:
        precision: float32, mixed_float16 or mixed_bfloat16.
        reason: One line saying why, for logs and `tfdist env`.
    """

    precision: Precision
    reason: str = ""

    def __post_init__(self) -> None:
        if self.precision not in _COMPUTE_DTYPE:
            raise ValueError(f"a PrecisionPolicy needs a concrete precision. "
                             f"Received: {self.precision}")

    @property
    def name(self) -> str:
        """The Keras dtype policy name."""
        return self.precision.value

    @property
    def compute_dtype(self) -> str:
        """The dtype layers compute in."""
        return _COMPUTE_DTYPE[self.precision]

    @property
    def variable_dtype(self) -> str:
        """The dtype weights are stored in: float32 under every policy."""
        return "float32"

    @property
    def loss_scaling(self) -> bool:
        """float16 gradients underflow without dynamic loss scaling; bfloat16's do not."""
        return self.precision is Precision.MIXED_FLOAT16

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """Sets Keras's global dtype policy inside the block, and restores it after.

        Layers take the global policy when they are constructed, so models built in
        the block keep it; nothing leaks to code that runs afterwards.
        """
        import keras

        previous = keras.config.dtype_policy()
        keras.config.set_dtype_policy(self.name)
        try:
            yield
        finally:
            keras.config.set_dtype_policy(previous)

    def wrap_optimizer(self, optimizer, *, finite_reduce_fn=None, **loss_scale_options):
        """Returns the optimizer with dynamic loss scaling where the policy needs it.

        Args:
            optimizer: A `keras.optimizers.Optimizer` that is not loss-scaled yet.
            finite_reduce_fn: Makes the skip decision for a non-finite step the
                same on every process (see `tfdist.optimizers`). None: each
                process decides for itself, as in Keras.
            **loss_scale_options: `initial_scale`, `dynamic_growth_steps`; also
                asks for loss scaling under a policy that would not use it.
        """
        if not (self.loss_scaling or loss_scale_options):
            return optimizer
        from tfdist.optimizers import AgreeingLossScaleOptimizer

        return AgreeingLossScaleOptimizer(optimizer, finite_reduce_fn=finite_reduce_fn,
                                          **loss_scale_options)


def resolve_precision(requested: Precision | None, *, strategy: Strategy,
                      cluster: ClusterInfo) -> PrecisionPolicy:
    """Chooses the policy a run uses.

    Args:
        requested: The config's precision: a policy, `auto`, or None for the
            strategy's default (mixed_bfloat16 on TPU, float32 elsewhere).
        strategy: The concrete strategy the run uses (not `auto`).
        cluster: What detection found: GPUs and their compute capability, CPU flags.

    Returns:
        A `PrecisionPolicy`. `auto` gives bfloat16 on TPUs, on GPUs of compute
        capability 8.0 or more, and on CPUs with AVX512_BF16 or AMX where a matmul
        probe (`tfdist.bfloat16_probe`, measured once per machine) finds bfloat16
        faster; float16 on older GPUs; float32 otherwise.

    Raises:
        ConfigError: the strategy cannot run the requested precision.
    """
    check_precision_supported(strategy, requested)
    if requested is None:
        if strategy is Strategy.TPU:
            return PrecisionPolicy(Precision.MIXED_BFLOAT16, "the TPU default")
        return PrecisionPolicy(Precision.FLOAT32, "the default")
    if requested is not Precision.AUTO:
        return PrecisionPolicy(requested, "requested")
    if strategy is Strategy.TPU:
        return PrecisionPolicy(Precision.MIXED_BFLOAT16, "auto: TPUs compute in bfloat16")
    if cluster.gpus:
        capabilities = [gpu.compute_capability or (0, 0) for gpu in cluster.gpus]
        if min(capabilities) >= (8, 0):
            return PrecisionPolicy(Precision.MIXED_BFLOAT16,
                                   f"auto: GPUs of compute capability {min(capabilities)} >= 8.0")
        return PrecisionPolicy(Precision.MIXED_FLOAT16,
                               f"auto: GPUs of compute capability {min(capabilities)} < 8.0")
    if cluster.cpu_bf16:
        from tfdist import bfloat16_probe

        try:
            return cpu_precision(bfloat16_probe.cached_probe(cluster))
        except (OSError, RuntimeError) as error:
            return PrecisionPolicy(Precision.FLOAT32, f"auto: the bfloat16 probe failed "
                                                      f"({error}); float32")
    return PrecisionPolicy(Precision.FLOAT32, "auto: no bfloat16 or float16 hardware found")


def cpu_precision(probe: Any) -> PrecisionPolicy:
    """`auto` on a CPU with bfloat16 instructions: mixed_bfloat16 only where it measured faster.

    Args:
        probe: A `tfdist.bfloat16_probe.MatmulProbe` of this machine.

    Example:

        cpu_precision(MatmulProbe(float32_gflops=274, bfloat16_gflops=159)).name  # "float32"
    """
    if probe.bfloat16_faster:
        return PrecisionPolicy(Precision.MIXED_BFLOAT16, f"auto: {probe.describe()}")
    return PrecisionPolicy(Precision.FLOAT32, f"auto: the CPU has bfloat16 instructions, but "
                                              f"{probe.describe()}: float32")
