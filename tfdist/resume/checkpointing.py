"""Checkpoints on disk: atomic, the newest few kept, a torn one passed over.

`CheckpointStore` keeps a run's `tf.train.Checkpoint`s in one folder through a
`tf.train.CheckpointManager`: each checkpoint's files are written first, and
the `checkpoint` state file that names them is replaced atomically afterwards,
so a process killed while saving leaves the previous checkpoints as they were.
Reading, the newest checkpoint that restores wins; a truncated or corrupt one is
passed over, and the one before it is used. The checkpoints are found by their own
files (`ckpt-<n>.index`) as well as by the `checkpoint` state file that lists them, so
a state file deleted or damaged loses no progress; `notes` says, for the run's one
resume line, what was passed over and why.

Processes that must take part in a save (reading a variable replicated across
workers is a collective) but should not leave files write to a private
temporary folder, emptied after each save.

`TrainingPosition` is where in training a checkpoint was taken: epoch, step in
the epoch, steps in all, and the format version, saved inside the checkpoint
itself, so position and state cannot disagree.

Example:

    position = TrainingPosition()
    store = CheckpointStore("ckpt", {"weights": model.variables, "position": position},
                            is_writer=True, keep=3)
    position.move_to(epoch=0, step=4, global_step=4)
    position.record()
    store.save(position.global_step)
    restored = store.restore_newest()     # the path restored, or None
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from typing import Any, Callable, Mapping

import tensorflow as tf
from absl import logging
from tensorflow.python.ops import resource_variable_ops

from tfdist.errors import ConfigError, first_line
from tfdist.files import writable_folder

# Bumped when what a checkpoint holds changes in a way an older reader would misread.
FORMAT_VERSION = 1

# What a torn, corrupt or missing checkpoint file raises when it is read: TensorFlow's
# errors (a bad index file is a bare OpError, "not an sstable"), and, for a truncated
# data file, IndexError ("Read less bytes than requested") from TensorFlow's reader.
_UNREADABLE = (tf.errors.OpError, IndexError)


class UnreadableCheckpoint(Exception):
    """Raised by `restore_newest`'s `also_restore` for files of a checkpoint that do not
    read (a rank's sharded state): the checkpoint is passed over like a torn one."""


CHECKPOINT_NAME = "ckpt"
STATE_FILE = "checkpoint"  # TensorFlow's list of a folder's checkpoints
_INDEX = re.compile(rf"{CHECKPOINT_NAME}-(\d+)\.index$")


class TrainingPosition(tf.Module):
    """Where training is: the state a checkpoint resumes from, beside the weights.

    The live values are Python integers, cheap to move at every step; `record`
    copies them into variables of this process (never distributed, the same on
    every process) just before a save, and `reload` reads them back after a
    restore.

    Attributes:
        epoch: The epoch in progress (0-based).
        step: Training steps done in that epoch.
        global_step: Training steps done since the start of the run.
        format_version: `FORMAT_VERSION` of the code that saved what was reloaded.
    """

    def __init__(self):
        super().__init__(name="tfdist_training_position")
        self.epoch = self.step = self.global_step = 0
        self.format_version = FORMAT_VERSION
        with tf.init_scope(), tf.device("/cpu:0"):
            # ResourceVariable: no strategy's variable creator intercepts it.
            def variable(name: str, value: int = 0) -> tf.Variable:
                return resource_variable_ops.ResourceVariable(
                    value, dtype=tf.int64, trainable=False, name=name)

            self.epoch_variable = variable("epoch")
            self.step_variable = variable("step")
            self.global_step_variable = variable("global_step")
            self.format_version_variable = variable("format_version", FORMAT_VERSION)

    @property
    def variables_to_save(self) -> list[tf.Variable]:
        return [self.epoch_variable, self.step_variable, self.global_step_variable,
                self.format_version_variable]

    def move_to(self, epoch: int, step: int, global_step: int) -> None:
        """Records that `step` steps of `epoch` are done, `global_step` in all."""
        self.epoch, self.step, self.global_step = epoch, step, global_step

    def record(self) -> None:
        """Copies the position into its variables, for a save."""
        for variable, value in zip(self.variables_to_save, (
                self.epoch, self.step, self.global_step, FORMAT_VERSION)):
            variable.assign(value)

    def reload(self) -> None:
        """Takes the position from its variables, after they were restored."""
        self.epoch, self.step, self.global_step, self.format_version = (
            int(variable.numpy()) for variable in self.variables_to_save)

    def describe(self) -> str:
        """Where this is, for people: epochs and steps counted from 1."""
        where = (f"the end of epoch {self.epoch}" if self.step == 0 and self.epoch
                 else f"epoch {self.epoch + 1}, step {self.step}")
        return f"{where} (step {self.global_step} in all)"


class CheckpointStore:
    """A folder of checkpoints of one set of objects.

    Args:
        directory: The run's checkpoint folder; every process reads from it.
        objects: What a checkpoint holds, by name (`tf.train.Checkpoint`'s keyword
            arguments): a model, an optimizer, variables, lists of them.
        is_writer: Whether this process's files are kept (the chief's). Other
            processes write to a private temporary folder, emptied after each save.
        keep: Checkpoints kept in `directory`; older ones are deleted.

    Attributes:
        notes: What reading the folder found wrong, one short phrase each (a state
            file missing or unreadable, a checkpoint passed over and why); empty when
            all was well.

    Raises:
        ConfigError: `directory` is not a folder this process can write in.
    """

    def __init__(self, directory: str | os.PathLike, objects: Mapping[str, Any], *,
                 is_writer: bool, keep: int):
        self.directory = os.fspath(directory)
        self.checkpoint = tf.train.Checkpoint(**objects)
        self._is_writer = is_writer
        self.notes: list[str] = []
        self._state_set_aside = False
        if is_writer:
            writable_folder(self.directory, "checkpoint_dir")
            self._set_aside_unreadable_state()
            write_directory, max_to_keep = self.directory, keep
        else:
            write_directory, max_to_keep = tempfile.mkdtemp(prefix="tfdist-not-chief-"), 1
        self._manager = tf.train.CheckpointManager(self.checkpoint, write_directory,
                                                   max_to_keep=max_to_keep,
                                                   checkpoint_name=CHECKPOINT_NAME)
        # Checkpoints found by their own files that the manager does not track (its state
        # file was lost): it never deletes them, so they stay kept; read once, here.
        self._kept_untracked = ({checkpoint_number(path) for path in self.candidates()}
                                - self._tracked_numbers()) if is_writer else set()

    def save(self, number: int) -> str:
        """Writes a checkpoint numbered `number` (the global step); returns its path."""
        path = self._manager.save(checkpoint_number=number)
        if not self._is_writer:
            shutil.rmtree(self._manager.directory, ignore_errors=True)
        return path if self._is_writer else os.path.join(self.directory,
                                                         os.path.basename(path))

    def kept_numbers(self) -> set[int]:
        """The numbers of the checkpoints in `directory` after the last save, known without
        reading the folder: those the store keeps, and those it found at its start by their
        own files. For the writer (the chief), which saves and deletes them."""
        return self._tracked_numbers() | self._kept_untracked

    def _tracked_numbers(self) -> set[int]:
        return {checkpoint_number(path) for path in self._manager.checkpoints}

    def candidates(self) -> list[str]:
        """The checkpoints in `directory`, newest first.

        Those the state file lists and those whose index file is in the folder: a
        checkpoint is kept when either names it, so a lost state file loses nothing.
        """
        numbers = {checkpoint_number(path) for path in self._listed()}
        for name in tf.io.gfile.listdir(self.directory) if tf.io.gfile.isdir(
                self.directory) else []:
            match = _INDEX.match(name)
            if match:
                numbers.add(int(match.group(1)))
        return [os.path.join(self.directory, f"{CHECKPOINT_NAME}-{number}")
                for number in sorted(numbers, reverse=True)]

    def restore_newest(self, also_restore: Callable[[str], None] | None = None) -> str | None:
        """Restores the newest checkpoint that reads whole; returns its path, or None.

        Each checkpoint passed over, and a state file missing or unreadable while
        checkpoints are there, is added to `notes`.

        Args:
            also_restore: Called with a checkpoint's path once its objects are restored,
                to restore what lies beside it; `UnreadableCheckpoint` from it passes the
                checkpoint over.

        Raises:
            ConfigError: a checkpoint was read but does not fit the objects (another
                model), or every checkpoint in the folder is unreadable.
        """
        candidates = self.candidates()
        if candidates:
            state = self._state_problem()
            if state:
                self.notes.append(f"the state file {STATE_FILE} {state}: the checkpoints "
                                  f"were found by their own files")
        passed_over = []
        for path in candidates:
            try:
                status = self.checkpoint.restore(path)
                status.assert_existing_objects_matched()
            except _UNREADABLE as error:
                reason = f"{type(error).__name__}: {first_line(error)}"
                logging.warning("tfdist: checkpoint %s cannot be read (%s); trying the one "
                                "before it", path, reason)
                passed_over.append(f"{os.path.basename(path)} ({reason})")
                continue
            except (AssertionError, ValueError) as error:
                raise ConfigError(f"checkpoint {path} does not fit this model and optimizer "
                                  f"({first_line(error)}); resume with the "
                                  f"same model, or start in an empty checkpoint_dir. "
                                  f"Received: checkpoint_dir={self.directory!r}") from None
            try:
                if also_restore is not None:
                    also_restore(path)
            except UnreadableCheckpoint as error:
                passed_over.append(f"{os.path.basename(path)} ({type(error).__name__}: "
                                   f"{first_line(error)})")
                continue
            if passed_over:
                self.notes.append(f"passed over, unreadable: {', '.join(passed_over)}")
            return path
        if candidates:
            raise ConfigError(f"none of the {len(candidates)} checkpoints in {self.directory} "
                              f"can be read (newest: {passed_over[0]}); move them away to "
                              f"start over. Received: checkpoint_dir={self.directory!r}")
        return None

    def _listed(self) -> list[str]:
        """The checkpoints the state file lists; none when it is missing or unreadable."""
        # TensorFlow logs two warnings for a state file that does not parse; `notes`
        # says it once, in the resume line.
        logger = tf.get_logger()
        level = logger.level
        logger.setLevel("ERROR")
        try:
            state = tf.train.get_checkpoint_state(self.directory)
        except ValueError:  # a state file without a newest checkpoint (an empty file)
            return []
        finally:
            logger.setLevel(level)
        if state is None:
            return []
        # TensorFlow has joined relative paths to the folder already.
        return list(state.all_model_checkpoint_paths) or [state.model_checkpoint_path]

    def _state_problem(self) -> str:
        """"" when the state file reads; else what is wrong with it, in a few words."""
        path = os.path.join(self.directory, STATE_FILE)
        if not tf.io.gfile.exists(path):
            # Only this start's own setting aside explains a missing state file: one set
            # aside by an earlier start says nothing about why it is missing now.
            return (f"was unreadable (set aside as {STATE_FILE}.unreadable)"
                    if self._state_set_aside else "is missing")
        return "" if self._listed() else "is unreadable"

    def _set_aside_unreadable_state(self) -> None:
        """Renames a state file that does not parse to `checkpoint.unreadable`.

        TensorFlow's CheckpointManager raises ValueError on an empty state file and
        logs a parse error for a damaged one; moved aside, the manager starts a new
        list, and the checkpoints themselves are found by their files.
        """
        path = os.path.join(self.directory, STATE_FILE)
        if tf.io.gfile.exists(path) and not self._listed():
            tf.io.gfile.rename(path, f"{path}.unreadable", overwrite=True)
            self._state_set_aside = True

    def close(self) -> None:
        """Removes this process's temporary folder, if it has one."""
        if not self._is_writer:
            shutil.rmtree(self._manager.directory, ignore_errors=True)


def read_partially(path: str, objects: Mapping[str, Any]) -> None:
    """Restores only `objects` (a subset of what was saved, under the same names).

    Example:

        read_partially(path, {"metrics": metric_variables})
    """
    tf.train.Checkpoint(**objects).read(path).expect_partial()


def checkpoint_number(path: str | None) -> int:
    """The number in a checkpoint's path (`.../ckpt-12` -> 12); -1 for None."""
    if path is None:
        return -1
    return int(path.rsplit("-", 1)[1])
