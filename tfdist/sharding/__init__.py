"""Sharded training state (ZeRO stages 1, 2 and 3): each rank holds 1/N of the optimizer state.

At stages 1 and 2 every data-parallel rank keeps the whole model, but only its
partition of the optimizer's state (Adam's moments, momentum, EMA averages), as
DeepSpeed's ZeRO and PyTorch's `ZeroRedundancyOptimizer` do, and at stage 2 only its
slice of each gradient; at stage 3 it stores only its slice of the weights too:

- **Stage 1**: the variables are dealt out whole to the ranks, largest first to
  the least loaded, so a rank holds at most the mean plus the largest variable.
  The gradients are averaged across ranks as without sharding; each rank applies
  the user's optimizer to the variables it owns, and the updated weights reach
  every rank in one all-gather. Any optimizer works, since every variable is
  updated whole.
- **Stage 2**: each variable is cut into N equal slices. The optimizer's build makes
  each weight's read an op whose gradient is a reduce-scatter
  (`ReduceScatteredWeight`), so the backward pass gives each rank its averaged slice
  of each gradient as the layer's gradient appears; each rank updates its slices, and
  an all-gather of each updated weight gives every rank the new weights: the bytes of
  one all-reduce. Slices are updated apart, so only optimizers whose update is
  element-wise qualify (`ELEMENT_WISE`).
- **Stage 3**: each trainable variable is created as this rank's slice of it
  (`sharded_creation`, which `runner.scope()` enters), read through an all-gather
  whose gradient is the same reduce-scatter (`ShardedWeight`); the optimizer updates
  the slices in place. Element-wise optimizers only. Each layer that creates weights
  is a unit of them (`Unit`): its call gathers them and drops them after, and its
  backward pass gathers them again and recomputes the call, so a rank holds one
  layer's whole weights at a time.

`sharded_optimizer(optimizer, collectives, stage)` returns an optimizer of the
user's own class (a subclass with the same name and module, so a saved model
loads in plain Keras), whose `build` creates state for the rank's partition only
and whose `apply` does the above. Clipping sees all gradients (the norms are summed
across ranks), weight decay and its exclusions, EMA, schedules and `iterations`
behave as on one device, and `optimizer.variables` lists the rank's share.

Example:

    optimizer = sharded_optimizer(keras.optimizers.Adam(1e-3), collectives, stage=2)
    model.compile(optimizer, "mse")    # each rank holds 1/N of Adam's moments
"""

from tfdist.sharding.collectives import OneRankCollectives, ShardCollectives
from tfdist.sharding.layout import Piece, ShardLayout, Slicing
from tfdist.sharding.optimizer import (ACCUMULATED, ELEMENT_WISE, WEIGHT, check_stage,
                                       find_sharded, sharded_optimizer)
from tfdist.sharding.state import Other, ShardPart, Slot, plain_order, state_bytes
from tfdist.sharding.units import Gathering, Unit, UnitState, units_of
from tfdist.sharding.weights import (ReduceScatteredWeight, ShardedWeight, is_sharded,
                                     sharded_creation, stored_variable)

__all__ = ["ACCUMULATED", "ELEMENT_WISE", "Gathering", "OneRankCollectives", "Other", "Piece",
           "ReduceScatteredWeight", "ShardCollectives", "ShardLayout", "ShardPart",
           "ShardedWeight", "Slicing", "Slot", "Unit", "UnitState", "WEIGHT",
           "check_stage", "find_sharded", "is_sharded", "plain_order",
           "sharded_creation", "sharded_optimizer", "state_bytes", "stored_variable",
           "units_of"]
