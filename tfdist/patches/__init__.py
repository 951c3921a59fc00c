"""Every fix tfdist makes to Keras, TensorFlow and Horovod, in one place.

Each fix is a `Patch`: one attribute replaced, a check that the upstream bug is still
in the installed code, the upstream issue, `apply` and `undo`. Nothing is applied on
`import tfdist`: each adapter applies the patches its strategy needs when it is built
(its `patches` attribute), and a replacement acts only where its bug applies, calling
the original everywhere else. `tfdist env` lists them all; `active()` names those in
place now.

One module per upstream component:

    keras_trainer         Keras's TensorFlow trainer (multi-worker fit, the
                          parameter-server fit/evaluate/predict routing, Horovod
                          Keras scripts' compile and model build)
    keras_variables       Keras's TensorFlow Variable (atomic updates on parameter servers)
    keras_optimizer       Keras's TensorFlow optimizer (sparse rows and replicas summed
                          before clipping; slots of sharded variables)
    tensorflow_backprop   GradientTape (gradients of sharded variables)
    tensorflow_distribute the strategies (sharded updates, collective keys, CPU replicas)
    keras_normalization   Keras's synchronized batch statistics (over Horovod's ranks)
    keras_callbacks       Keras's BackupAndRestore, ModelCheckpoint, CSVLogger,
                          TensorBoard and progress bar (one writer across processes)
    keras_export          Keras's Model.export (the whole weights of ZeRO stage 3)
    horovod_tensorflow    horovod.tensorflow (Keras 3 variables in its ops)

Example:

    from tfdist import patches

    patches.apply(patches.MULTI_WORKER)   # the names applied by this call
    patches.active()
    patches.undo(patches.MULTI_WORKER)
"""

from __future__ import annotations

from typing import Iterable

from tfdist.patches import (horovod_tensorflow, keras_callbacks, keras_export,
                            keras_normalization, keras_optimizer, keras_trainer,
                            keras_variables, tensorflow_backprop, tensorflow_distribute)
from tfdist.patches.base import Patch, registered

# What every adapter applies when it is built (and `tfdist.horovod.keras.init()`): the
# update one device would make from the summed gradient.
EXACT_UPDATES: tuple[Patch, ...] = (
    keras_optimizer.REPLICA_SUM_ONCE,
    keras_optimizer.SUMMED_BEFORE_CLIPPING,
)
# What each strategy applies besides, when its adapter is built.
MULTI_WORKER: tuple[Patch, ...] = (
    keras_trainer.MULTI_WORKER_SYMBOLIC_BUILD,
    keras_trainer.MULTI_WORKER_METRIC_REDUCTION,
    keras_callbacks.BACKUP_ONE_WRITER,
    keras_callbacks.BACKUP_ONE_CLEANER,
    *keras_callbacks.USER_FILE_WRITERS,
    keras_callbacks.PROGRESS_ON_THE_CHIEF,
)
PARAMETER_SERVER: tuple[Patch, ...] = (
    keras_variables.ATOMIC_ASSIGN_ADD,
    keras_variables.ATOMIC_ASSIGN_SUB,
    tensorflow_backprop.SHARDED_VARIABLE_GRADIENTS,
    tensorflow_distribute.SHARDED_VARIABLE_UPDATES,
    keras_optimizer.SHARDED_SLOT_VARIABLES,
    keras_trainer.PARAMETER_SERVER_FIT,
    keras_trainer.PARAMETER_SERVER_EVALUATE,
    keras_trainer.PARAMETER_SERVER_PREDICT,
)
# The `horovod` adapter (and `tfdist.horovod.keras.init()`, with HOROVOD_KERAS).
HOROVOD: tuple[Patch, ...] = (
    *EXACT_UPDATES,
    keras_normalization.HOROVOD_SYNCHRONIZED_MOMENTS,
    horovod_tensorflow.BROADCAST_VARIABLES,
    horovod_tensorflow.TAPE_GRADIENT,
    horovod_tensorflow.TAPE_LOCAL_SOURCE,
    horovod_tensorflow.TAPE_LOCAL_AND_GLOBAL_GRADIENTS,
    keras_callbacks.BACKUP_ONE_WRITER,
    keras_callbacks.BACKUP_ONE_CLEANER,
    *keras_callbacks.USER_FILE_WRITERS,
    keras_callbacks.PROGRESS_ON_THE_CHIEF,
    keras_export.ZERO3_WHOLE_WEIGHTS,
    keras_trainer.ZERO_BUILD_IN_CREATION_SCOPE,
)
# `tfdist.parallel`'s layers, when built: one model over several devices of a process.
MODEL_PARALLEL: tuple[Patch, ...] = (
    keras_optimizer.SLOTS_BESIDE_THEIR_VARIABLES,
)
# `tfdist.horovod.keras.init()`: Horovod's own Keras scripts, which build no strategy.
HOROVOD_KERAS: tuple[Patch, ...] = (
    *HOROVOD,
    keras_trainer.HOROVOD_BUILD_BEFORE_CALLBACKS,
    keras_trainer.HOROVOD_COMPILE_KEYWORD,
)


def apply(patches: Iterable[Patch]) -> list[str]:
    """Applies each patch whose bug is present and that is not applied yet.

    Returns:
        The names applied by this call.
    """
    return [patch.name for patch in patches if patch.apply()]


def undo(patches: Iterable[Patch]) -> list[str]:
    """Undoes each patch that is applied, the one applied last first.

    Two patches of one attribute (Keras's `_maybe_symbolic_build` has two) stack in the
    order they were applied, whatever order the tuples list them in; undoing in the
    reverse of that order puts back exactly what was installed.

    Returns:
        The names undone by this call.
    """
    applied = sorted((patch for patch in patches if patch.active),
                     key=lambda patch: patch.application, reverse=True)
    return [patch.name for patch in applied if patch.undo()]


def undo_all() -> list[str]:
    """Undoes every active patch: Keras, TensorFlow and Horovod are as installed."""
    return undo(registered())


def active() -> list[str]:
    """The names of the patches in place now."""
    return [patch.name for patch in registered() if patch.active]


def by_name(name: str) -> Patch:
    """The patch called `name`.

    Raises:
        KeyError: no patch has that name (the message lists them).
    """
    for patch in registered():
        if patch.name == name:
            return patch
    raise KeyError(f"no patch named {name!r}; known: "
                   f"{', '.join(patch.name for patch in registered())}")


__all__ = ["EXACT_UPDATES", "HOROVOD", "HOROVOD_KERAS", "MODEL_PARALLEL", "MULTI_WORKER",
           "PARAMETER_SERVER", "Patch", "active", "apply", "by_name", "registered", "undo",
           "undo_all"]
