"""Patches to Keras 3's own `BackupAndRestore` (`keras/src/callbacks/backup_and_restore.py`).

Under `MultiWorkerMirroredStrategy` every worker runs the user's callbacks, and Keras 3's
`BackupAndRestore` has every worker write the same `latest.weights.h5` and
`training_metadata.json` in the backup folder, and delete it at the end of training.
TensorFlow's multi-worker tutorial (tensorflow/docs, `multi_worker_with_keras.ipynb`)
passes it to `fit` exactly so; with 2 workers it crashed at the first backup in 3 of 3
runs (`FileExistsError`, or h5py's `BlockingIOError: unable to lock file`), and so did
the restarted run. TensorFlow's Keras 2 had every other worker write to a temporary
folder of its own (`distributed_file_utils`); Keras 3 dropped that. Under Horovod every
rank runs it the same way.

The replacements give the callback one writer, as tfdist's `runner.writable_dir`
does: on a worker other than the chief (a Horovod rank other than 0) the save goes to a
private temporary folder, removed when the process ends, and the end of training
deletes nothing shared. Every worker still reads the chief's folder when it starts,
so a restarted group resumes from one backup. Where the process is the only writer
(one process, or the chief) Keras's own code runs unchanged.

Example:

    from tfdist import patches

    patches.apply(patches.MULTI_WORKER)   # among them, these two
"""

from __future__ import annotations

import atexit
import contextlib
import shutil
import tempfile
from typing import Any, Callable, Iterator

from tfdist.patches.base import Patch, source_contains
from tfdist.patches.keras_normalization import initialized_horovod

# The callback's attributes that name files it writes.
_PATHS = ("backup_dir", "_weights_path", "_training_metadata_path", "_prev_weights_path",
          "_prev_training_metadata_path")


def _callback_class() -> Any:
    from keras.src.callbacks import backup_and_restore

    return backup_and_restore.BackupAndRestore


def writes_shared_files(model: Any) -> bool:
    """Whether this process is the one that writes a run's shared files for `model`.

    The chief under `MultiWorkerMirroredStrategy` (its `should_checkpoint`), rank 0
    under Horovod with several ranks, and every process otherwise.
    """
    hvd = initialized_horovod()
    if hvd is not None and hvd.size() > 1:
        return hvd.rank() == 0
    strategy = getattr(model, "distribute_strategy", None)
    return bool(getattr(getattr(strategy, "extended", None), "should_checkpoint", True))


@contextlib.contextmanager
def _writing_to_scratch(callback: Any) -> Iterator[None]:
    """The callback's file paths point into this process's private folder for the block."""
    scratch = getattr(callback, "_tfdist_scratch", None)
    if scratch is None:
        scratch = callback._tfdist_scratch = tempfile.mkdtemp(prefix="tfdist-not-chief-")
        atexit.register(shutil.rmtree, scratch, ignore_errors=True)
    shared = {name: getattr(callback, name) for name in _PATHS}
    folder = shared["backup_dir"]
    for name, path in shared.items():
        setattr(callback, name, scratch + path[len(folder):])
    try:
        yield
    finally:
        for name, path in shared.items():
            setattr(callback, name, path)


def _one_writer_save(original: Callable) -> Callable:
    def _save_model(self):
        if writes_shared_files(self.model):
            return original(self)
        # Still saved, not skipped: reading a sync-on-read variable is a collective
        # every worker must join.
        with _writing_to_scratch(self):
            return original(self)

    return _save_model


def _one_writer_cleanup(original: Callable) -> Callable:
    def on_train_end(self, logs=None):
        if writes_shared_files(self.model):
            return original(self, logs)
        with _writing_to_scratch(self):
            return original(self, logs)

    return on_train_end


_UPSTREAM = ("none filed: Keras 3 dropped tf.keras's per-worker temporary folders "
             "(distributed_file_utils)")

BACKUP_ONE_WRITER = Patch(
    "keras.callbacks.backup_and_restore_one_writer",
    owner=_callback_class, attribute="_save_model", replacement=_one_writer_save,
    bug_present=lambda original: (source_contains(original, "save_weights")
                                  and not source_contains(original, "chief")),
    upstream=_UPSTREAM,
    summary="every worker writes the same backup files: FileExistsError or 'unable to "
            "lock file' at the first backup")

BACKUP_ONE_CLEANER = Patch(
    "keras.callbacks.backup_and_restore_one_cleaner",
    owner=_callback_class, attribute="on_train_end", replacement=_one_writer_cleanup,
    bug_present=lambda original: (source_contains(original, "rmtree")
                                  and not source_contains(original, "chief")),
    upstream=_UPSTREAM,
    summary="every worker deletes the shared backup folder at the end of training")
