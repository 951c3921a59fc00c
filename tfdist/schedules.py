"""Learning-rate scaling by the number of replicas, with a linear warmup.

With k times the batch, Goyal et al. (2017, "Accurate, Large Minibatch SGD")
multiply the learning rate by k, and ramp up to it linearly over the first
updates so early training does not diverge. `ScaledWarmup` does that on top of
any base rate or schedule, inside the optimizer, so it follows
`optimizer.iterations` exactly and is saved with the optimizer.

Example:

    optimizer.learning_rate = ScaledWarmup(0.1, multiplier=8, warmup_steps=500)
    # update 0: 0.1; update 250: 0.45; update 500 and after: 0.8
"""

from __future__ import annotations

from typing import Any

import keras
from keras import ops


@keras.saving.register_keras_serializable(package="tfdist")
class ScaledWarmup(keras.optimizers.schedules.LearningRateSchedule):
    """`base(step) * m(step)`, with m rising linearly from 1 to `multiplier`.

    Args:
        base: The unscaled learning rate: a float or a `LearningRateSchedule`.
        multiplier: The factor reached after the warmup, usually the replica count.
        warmup_steps: Updates over which the factor rises; 0 applies it at once.

    Example:

        ScaledWarmup(keras.optimizers.schedules.CosineDecay(0.1, 10_000),
                     multiplier=4, warmup_steps=100)
    """

    def __init__(self, base: Any, multiplier: float, warmup_steps: int = 0):
        if multiplier <= 0:
            raise ValueError(f"multiplier must be > 0. Received: multiplier={multiplier}")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0. Received: warmup_steps={warmup_steps}")
        self.base = base
        self.multiplier = float(multiplier)
        self.warmup_steps = int(warmup_steps)

    def __call__(self, step: Any) -> Any:
        step = ops.cast(step, "float32")
        base = self.base(step) if callable(self.base) else ops.cast(self.base, "float32")
        if self.warmup_steps == 0:
            return base * self.multiplier
        progress = ops.minimum(step / float(self.warmup_steps), 1.0)
        return base * (1.0 + (self.multiplier - 1.0) * progress)

    def get_config(self) -> dict[str, Any]:
        base = (keras.optimizers.schedules.serialize(self.base)
                if isinstance(self.base, keras.optimizers.schedules.LearningRateSchedule)
                else float(self.base))
        return {"base": base, "multiplier": self.multiplier, "warmup_steps": self.warmup_steps}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "ScaledWarmup":
        config = dict(config)
        if isinstance(config["base"], dict):
            config["base"] = keras.optimizers.schedules.deserialize(config["base"])
        return cls(**config)
