"""Patches to Keras 3's callbacks that write files or the console: one writer across processes.

`BackupAndRestore` (`keras/src/callbacks/backup_and_restore.py`), and the user's
`ModelCheckpoint`, `CSVLogger` and `TensorBoard`, which every process of a multi-process
run executes with the same paths; on a shared file system they write one file at once. And
`ProgbarLogger`, which `fit` adds by itself: every process draws the same progress bar.

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
import functools
import os
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
    scratch = _scratch(callback)
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


def _scratch(callback: Any) -> str:
    """This process's private folder for `callback`'s files, removed when it ends."""
    scratch = getattr(callback, "_tfdist_scratch", None)
    if scratch is None:
        scratch = callback._tfdist_scratch = tempfile.mkdtemp(prefix="tfdist-not-chief-")
        atexit.register(shutil.rmtree, scratch, ignore_errors=True)
    return scratch


@contextlib.contextmanager
def _paths_in_scratch(callback: Any, names: tuple[str, ...]) -> Iterator[None]:
    """Each attribute in `names` (a path) points to the same place under the callback's
    private folder for the block: an absolute path below it, a relative one too."""
    scratch = _scratch(callback)
    shared = {name: getattr(callback, name) for name in names}
    for name, path in shared.items():
        private = os.path.join(scratch, os.path.abspath(path).lstrip(os.sep))
        # Its folder, as the user made theirs (CSVLogger opens its file without making it).
        os.makedirs(os.path.dirname(private), exist_ok=True)
        setattr(callback, name, private)
    try:
        yield
    finally:
        for name, path in shared.items():
            setattr(callback, name, path)


def _one_writer(paths: tuple[str, ...], model_argument: bool = False) -> Callable:
    """A replacement that runs the original on the chief, and with `paths` in this
    process's private folder elsewhere (still run: a save may read variables whose read
    is a collective every process joins)."""
    def replacement(original: Callable) -> Callable:
        @functools.wraps(original)
        def method(self, *args, **kwargs):
            model = args[0] if model_argument else self.model
            if writes_shared_files(model):
                return original(self, *args, **kwargs)
            with _paths_in_scratch(self, paths):
                return original(self, *args, **kwargs)

        return method

    return replacement


def _progbar_logger_class() -> Any:
    from keras.src.callbacks import progbar_logger

    return progbar_logger.ProgbarLogger


def _progress_on_the_chief(original: Callable) -> Callable:
    @functools.wraps(original)
    def set_params(self, params):
        original(self, params)
        if not writes_shared_files(self.model):
            # What Horovod's docs ask of every script: `verbose=1 if hvd.rank() == 0 else 0`.
            self.verbose = 0

    return set_params


def _model_checkpoint_class() -> Any:
    from keras.src.callbacks import model_checkpoint

    return model_checkpoint.ModelCheckpoint


def _csv_logger_class() -> Any:
    from keras.src.callbacks import csv_logger

    return csv_logger.CSVLogger


def _tensorboard_class() -> Any:
    from keras.src.callbacks import tensorboard

    return tensorboard.TensorBoard


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

CHECKPOINT_ONE_WRITER = Patch(
    "keras.callbacks.model_checkpoint_one_writer",
    owner=_model_checkpoint_class, attribute="_save_model",
    replacement=_one_writer(("filepath",)),
    bug_present=lambda original: (source_contains(original, "self.model.save")
                                  and not source_contains(original, "chief")),
    upstream=_UPSTREAM,
    summary="every process saves the user's ModelCheckpoint file at the same path")

CSV_LOGGER_ONE_WRITER = Patch(
    "keras.callbacks.csv_logger_one_writer",
    owner=_csv_logger_class, attribute="on_train_begin",
    replacement=_one_writer(("filename",)),
    bug_present=lambda original: (source_contains(original, "self.filename")
                                  and not source_contains(original, "chief")),
    upstream=_UPSTREAM,
    summary="every process writes the user's CSVLogger file at the same path")

TENSORBOARD_ONE_WRITER = Patch(
    "keras.callbacks.tensorboard_one_writer",
    owner=_tensorboard_class, attribute="set_model",
    replacement=_one_writer(("log_dir",), model_argument=True),
    bug_present=lambda original: (source_contains(original, "self.log_dir")
                                  and not source_contains(original, "chief")),
    upstream=_UPSTREAM,
    summary="every process writes the user's TensorBoard logs in the same folder")

# The user's own callbacks that write files, under every multi-process strategy.
USER_FILE_WRITERS = (CHECKPOINT_ONE_WRITER, CSV_LOGGER_ONE_WRITER, TENSORBOARD_ONE_WRITER)

PROGRESS_ON_THE_CHIEF = Patch(
    "keras.callbacks.progress_bar_on_the_chief",
    owner=_progbar_logger_class, attribute="set_params", replacement=_progress_on_the_chief,
    bug_present=lambda original: (source_contains(original, "self.verbose = verbose")
                                  and not source_contains(original, "chief")),
    upstream="none filed: Keras 3 draws fit's progress bar in every process of a "
             "multi-process run",
    summary="every process prints fit's progress bars: N bars an epoch, their lines run "
            "together")
