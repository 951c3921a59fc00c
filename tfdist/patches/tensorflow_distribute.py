"""Patches to TensorFlow's distribution strategies (`tensorflow/python/distribute`).

- `SHARDED_VARIABLE_UPDATES`: ParameterServerStrategy refuses to update a
  ShardedVariable (keras-team/keras#18624 left Keras 3 without parameter-server
  training, so nothing upstream takes this path).
- `MIRRORED_COLLECTIVE_KEYS`: each MirroredStrategy gets collective keys of its own
  while it is built (tensorflow/tensorflow#62790).
- `MULTI_WORKER_CPU_REPLICAS`: a CPU-only worker gets several replicas while its
  MultiWorkerMirroredStrategy is built (`multi_worker.cpu_replicas`).

The last two are temporary: `with patch.applied(...)` around the constructor, undone
as soon as the strategy exists.

Example:

    from tfdist.patches import tensorflow_distribute

    with tensorflow_distribute.MIRRORED_COLLECTIVE_KEYS.applied():
        strategy = tf.distribute.MirroredStrategy()
"""

from __future__ import annotations

import itertools
from typing import Any, Callable

from tfdist.patches.base import Patch, source_contains


def _parameter_server_extended() -> Any:
    from tensorflow.python.distribute import parameter_server_strategy_v2

    return parameter_server_strategy_v2.ParameterServerStrategyV2Extended


def _update_in_place(original: Callable) -> Callable:
    from tensorflow.python.distribute import distribute_lib, sharded_variable

    def _update(self, var, fn, args, kwargs, group):
        if not isinstance(var, sharded_variable.ShardedVariable):
            return original(self, var, fn, args, kwargs, group)
        # A ShardedVariable places each shard's part of an update (assign_sub,
        # scatter_sub split by rows) on that shard's server itself.
        with distribute_lib.UpdateContext(var.variables[0].device):
            return fn(var, *self._select_single_value(args),
                      **self._select_single_value(kwargs))

    return _update


SHARDED_VARIABLE_UPDATES = Patch(
    "tensorflow.distribute.sharded_variable_updates",
    owner=_parameter_server_extended, attribute="_update", replacement=_update_in_place,
    bug_present=lambda original: (source_contains(original, "It must be a Variable")
                                  and not source_contains(original, "ShardedVariable")),
    upstream="keras-team/keras#18624 (Keras 3 optimizers update through "
             "strategy.extended.update)",
    summary="the Keras optimizer cannot update a ShardedVariable: 'You can not update "
            "`var` ... It must be a Variable'")


def _mirrored_strategy_class() -> Any:
    import tensorflow as tf

    return tf.distribute.MirroredStrategy


# Every MirroredStrategy numbers its collective groups from 1 and their instances from
# 100. A second strategy in the same process (a notebook, a sweep, a second Runner)
# reuses the first one's keys, and once the tensors differ the runtime's cached
# collectives fail with "Shape mismatch in the collective instance 100". TensorFlow's
# own tests give each strategy a key base through the class attribute
# `_collective_key_base`, read once in the constructor; so does this patch.
_GROUP_KEYS_PER_STRATEGY = 10_000
_strategy_serial = itertools.count(1)


def _shares_one_key_base(original: Any) -> bool:
    from tensorflow.python.distribute import mirrored_strategy

    return source_contains(mirrored_strategy.MirroredExtended.__init__,
                           "container_strategy._collective_key_base")


MIRRORED_COLLECTIVE_KEYS = Patch(
    "tensorflow.distribute.mirrored_collective_keys",
    owner=_mirrored_strategy_class, attribute="_collective_key_base",
    replacement=lambda original: next(_strategy_serial) * _GROUP_KEYS_PER_STRATEGY,
    bug_present=_shares_one_key_base,
    upstream="tensorflow/tensorflow#62790",
    summary="a second MirroredStrategy in one process fails: 'Shape mismatch in the "
            "collective instance 100'")


def _collective_extended() -> Any:
    from tensorflow.python.distribute import collective_all_reduce_strategy

    return collective_all_reduce_strategy.CollectiveAllReduceExtended


def _cpu_devices(original: Callable, replicas: int) -> Callable:
    def _initialize_local_devices(self, cluster_resolver, worker_device):
        devices = tuple(f"{worker_device}/device:CPU:{i}" for i in range(replicas))
        return devices, "CPU"

    return _initialize_local_devices


MULTI_WORKER_CPU_REPLICAS = Patch(
    "tensorflow.distribute.multi_worker_cpu_replicas",
    owner=_collective_extended, attribute="_initialize_local_devices",
    replacement=_cpu_devices,
    bug_present=lambda original: source_contains(original, "num_local_devices = 1"),
    upstream="none: MultiWorkerMirroredStrategy takes no device list, and puts one "
             "replica on a worker without GPUs",
    summary="a CPU-only worker cannot run the code path of several GPUs per worker")
