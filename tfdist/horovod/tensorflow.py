"""`horovod.tensorflow` for Keras 3: a custom training loop changes one import line.

    import tfdist.horovod.tensorflow as hvd     # was: import horovod.tensorflow as hvd

Every public name of Horovod 0.28.1's `horovod.tensorflow` is here, with its signature:
this module hands out Horovod's own objects, looked up when they are used, so that the
fixes `init()` applies are the ones a script calls. On Keras 3, Horovod's
`broadcast_variables(model.variables, 0)` and `DistributedGradientTape(tape).gradient(
loss, model.trainable_variables)` fail with AttributeError (a Keras 3 variable has no
`ref()`, horovod/horovod#4290); after `init()` they take Keras variables.

Two names differ from Horovod's:

- `init()` initialises Horovod, then applies `tfdist.patches.HOROVOD_KERAS`, as
  `tfdist.horovod.keras.init()` does. Importing this module changes nothing.
- `DistributedOptimizer(opt)` of a Keras 3 optimizer returns
  `tfdist.horovod.keras.DistributedOptimizer(opt, ...)`: Horovod's hands it to
  `horovod.tensorflow.keras`, whose optimizer does not reduce on Keras 3 (each rank
  silently trains on its own gradients). A `tf.compat.v1` optimizer goes to Horovod's.

Example (every rank, under `mpirun -np 2`):

    hvd.init()
    with tf.GradientTape() as tape:
        loss = loss_fn(labels, model(images, training=True))
    tape = hvd.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    hvd.broadcast_variables(model.variables, root_rank=0)   # after the first step
"""

from __future__ import annotations

from typing import Any

import horovod.tensorflow as _hvd
import keras
from horovod.tensorflow.compression import Compression
from horovod.tensorflow.mpi_ops import Average, global_process_set

from tfdist import patches as _patches


def init(*args: Any, **kwargs: Any) -> None:
    """Initialises Horovod (`horovod.tensorflow.init`'s arguments), then applies the fixes
    Horovod's code needs on Keras 3 (`tfdist.patches.HOROVOD_KERAS`; `tfdist env` lists
    them).

    Example:

        hvd.init()
        hvd.rank(), hvd.size()
    """
    _hvd.init(*args, **kwargs)
    _patches.apply(_patches.HOROVOD_KERAS)


def DistributedOptimizer(optimizer: Any, name: str | None = None, use_locking: bool = False,
                         device_dense: str = "", device_sparse: str = "",
                         compression: Any = Compression.none, sparse_as_dense: bool = False,
                         backward_passes_per_step: int = 1, op: Any = Average,
                         gradient_predivide_factor: float = 1.0,
                         average_aggregated_gradients: bool = False, num_groups: int = 0,
                         groups: Any = None, process_set: Any = global_process_set,
                         scale_local_gradients: bool = True) -> Any:
    """`optimizer` with its gradients reduced across ranks before every update.

    The parameters not listed below are Horovod's, as
    `tfdist.horovod.keras.DistributedOptimizer` takes them.

    Args:
        optimizer: A Keras 3 optimizer (`tfdist.horovod.keras.DistributedOptimizer` wraps
            it), or a `tf.compat.v1.train.Optimizer` (Horovod's own wraps it).
        use_locking: Horovod's, for a `tf.compat.v1` optimizer (Keras optimizers take none).

    Returns:
        The distributed optimizer.

    Example:

        opt = hvd.DistributedOptimizer(keras.optimizers.Adam(1e-3 * hvd.size()))
    """
    if isinstance(optimizer, keras.optimizers.Optimizer):
        from tfdist.horovod import keras as horovod_keras

        return horovod_keras.DistributedOptimizer(
            optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse,
            compression=compression, sparse_as_dense=sparse_as_dense,
            gradient_predivide_factor=gradient_predivide_factor, op=op,
            backward_passes_per_step=backward_passes_per_step,
            average_aggregated_gradients=average_aggregated_gradients, num_groups=num_groups,
            groups=groups, process_set=process_set,
            scale_local_gradients=scale_local_gradients)
    return _hvd.DistributedOptimizer(
        optimizer, name=name, use_locking=use_locking, device_dense=device_dense,
        device_sparse=device_sparse, compression=compression, sparse_as_dense=sparse_as_dense,
        backward_passes_per_step=backward_passes_per_step, op=op,
        gradient_predivide_factor=gradient_predivide_factor,
        average_aggregated_gradients=average_aggregated_gradients, num_groups=num_groups,
        groups=groups, process_set=process_set, scale_local_gradients=scale_local_gradients)


_OWN = {"init", "DistributedOptimizer"}


def public_names() -> list[str]:
    """Horovod's public names that this module gives (its modules left out)."""
    return sorted(name for name in dir(_hvd) if not name.startswith("_")
                  and type(getattr(_hvd, name)).__name__ != "module")


def __getattr__(name: str) -> Any:
    # Looked up at each use, not copied at import: `init()` replaces some of Horovod's
    # attributes (broadcast_variables), and a copy would keep the unfixed one.
    if name.startswith("_") or name not in public_names():
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(_hvd, name)


def __dir__() -> list[str]:
    return sorted(set(public_names()) | _OWN | set(globals()))
