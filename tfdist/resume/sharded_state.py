"""Each rank's partition of the optimizer state on disk, read back by any number of ranks.

Under `zero_stage` 1 or 2 (`tfdist.sharding`) no process holds the whole optimizer
state, so the chief's checkpoint holds what every rank holds alike (weights, step,
learning rate), and each rank writes its partition beside it:
`shards/ckpt-<step>.rank<R>-of-<N>.npz`, one array per slot of each piece of a
variable it updates, named by (variable, slot, element range). A rank writes its
file atomically (a temporary file and a rename) before the chief's checkpoint is
written, so a checkpoint the store names always has its shards.

Reading, a rank takes each of its pieces' elements from whichever files hold them,
so a run resumes on another number of ranks, or at the other stage, re-partitioned.

Example:

    write_shard("ckpt", 40, rank=0, ranks=2, state=optimizer.shard_state())
    with ShardReader("ckpt", 40) as reader:  # every rank's files of checkpoint 40
        optimizer.load_shard_state(reader.read)
"""

from __future__ import annotations

import io
import json
import os
import re
import zipfile
import zlib
from typing import Iterable, NamedTuple

import numpy as np
import tensorflow as tf

from tfdist.errors import ConfigError, first_line
from tfdist.resume.checkpointing import UnreadableCheckpoint
from tfdist.sharding.state import ShardPart

FOLDER = "shards"
_NAME = re.compile(r"ckpt-(\d+)\.rank(\d+)-of-(\d+)\.npz$")


class _Stored(NamedTuple):
    """Where a part of a slot is in the shard files: its elements, its file, its member."""

    start: int
    stop: int
    path: str
    member: str


# What a truncated or damaged .npz raises as it is opened or a member read: zipfile's
# BadZipFile, zlib's error, EOFError, OSError, ValueError (its JSON index, NumPy's header),
# KeyError (a member missing from a torn archive).
_DAMAGED = (zipfile.BadZipFile, zlib.error, EOFError, OSError, ValueError, KeyError)


class UnreadableShards(ConfigError, UnreadableCheckpoint):
    """A checkpoint's shard files are missing for some ranks, truncated or damaged."""


def shard_path(directory: str, number: int, rank: int, ranks: int) -> str:
    """Where rank `rank` of `ranks` keeps its partition of checkpoint `number`."""
    return os.path.join(directory, FOLDER, f"ckpt-{number}.rank{rank}-of-{ranks}.npz")


def write_shard(directory: str, number: int, rank: int, ranks: int,
                state: Iterable[ShardPart]) -> str:
    """Writes one rank's partition: its parts of each slot (`ShardPart`s).

    Returns:
        The path written.
    """
    index, arrays = [], {}
    for position, part in enumerate(ShardPart(*part) for part in state):
        index.append([part.variable, part.slot, part.start, part.stop])
        arrays[f"a{position}"] = part.values
    buffer = io.BytesIO()
    np.savez(buffer, index=np.array(json.dumps(index)), **arrays)
    path = shard_path(directory, number, rank, ranks)
    tf.io.gfile.makedirs(os.path.dirname(path))
    temporary = f"{path}.tmp{os.getpid()}"
    with tf.io.gfile.GFile(temporary, "wb") as stream:
        stream.write(buffer.getvalue())
    tf.io.gfile.rename(temporary, path, overwrite=True)
    return path


def numbers(directory: str) -> set[int]:
    """The checkpoint numbers that have shard files."""
    folder = os.path.join(directory, FOLDER)
    if not tf.io.gfile.isdir(folder):
        return set()
    return {int(match.group(1)) for match in map(_NAME.match, tf.io.gfile.listdir(folder))
            if match}


def remove_other_than(directory: str, kept: Iterable[int]) -> None:
    """Deletes the shard files of checkpoints not in `kept` (the store deleted those)."""
    kept = set(kept)
    folder = os.path.join(directory, FOLDER)
    if not tf.io.gfile.isdir(folder):
        return
    for name in tf.io.gfile.listdir(folder):
        match = _NAME.match(name)
        if match and int(match.group(1)) not in kept:
            tf.io.gfile.remove(os.path.join(folder, name))


class ShardReader:
    """Every rank's partition of one checkpoint, read by element range.

    Args:
        directory: The checkpoint folder.
        number: The checkpoint's number (its global step).

    Raises:
        ConfigError: the checkpoint has no shard files, or not all of its ranks'.
    """

    def __init__(self, directory: str, number: int):
        folder = os.path.join(directory, FOLDER)
        names = tf.io.gfile.listdir(folder) if tf.io.gfile.isdir(folder) else []
        found = {int(m.group(2)): (int(m.group(3)), os.path.join(folder, name))
                 for name in names if (m := _NAME.match(name)) and int(m.group(1)) == number}
        ranks = {count for count, _ in found.values()}
        if not found and numbers(directory):
            raise UnreadableShards(f"checkpoint {number} has no shard files, though other "
                                   f"checkpoints in the folder have theirs")
        if not found:
            raise ConfigError(f"checkpoint {number} in {directory} has no sharded optimizer "
                              f"state (it was saved with zero_stage 0); resume it with zero_stage "
                              f"0, or start in an empty checkpoint_dir. "
                              f"Received: checkpoint_dir={directory!r}")
        if len(ranks) != 1 or sorted(found) != list(range(next(iter(ranks)))):
            raise UnreadableShards(f"checkpoint {number} lacks the shard files of some ranks "
                                   f"(found ranks {sorted(found)})")
        self._pieces: dict[tuple[int, str], list[_Stored]] = {}
        self._files = {}
        self._handles = []
        for rank, (_, path) in sorted(found.items()):
            # Members are read when asked for: a rank reads only the ranges it updates.
            self._handles.append(tf.io.gfile.GFile(path, "rb"))
            try:
                archive = np.load(self._handles[-1])
                self._files[path] = archive
                index = json.loads(str(archive["index"]))
            except _DAMAGED as error:
                self.close()
                raise _unreadable(path, error) from None
            for position, (variable, slot, start, stop) in enumerate(index):
                self._pieces.setdefault((variable, slot), []).append(
                    _Stored(start, stop, path, f"a{position}"))

    def slots(self) -> set[str]:
        """The names of the slots the files hold (the weights' too, saved at zero_stage 3)."""
        return {slot for _, slot in self._pieces}

    def read(self, variable: int, slot: str, start: int, stop: int) -> np.ndarray:
        """Elements [start, stop) of slot `slot` of variable `variable`, flattened.

        Raises:
            ConfigError: the checkpoint does not hold all of them (another model).
        """
        out, covered = None, 0
        for stored in self._pieces.get((variable, slot), []):
            low, high = stored.start, stored.stop
            lo, hi = max(low, start), min(high, stop)
            if lo < hi:
                try:
                    values = self._files[stored.path][stored.member]
                except _DAMAGED as error:
                    raise _unreadable(stored.path, error) from None
                if out is None:
                    out = np.zeros([stop - start], values.dtype)
                out[lo - start:hi - start] = values[lo - low:hi - low]
                covered += hi - lo
        if out is None or covered != stop - start:
            raise ConfigError(f"the sharded optimizer state of this checkpoint does not cover "
                              f"slot {slot!r} of variable {variable} (elements {start}-{stop}): "
                              f"it was saved for another model or optimizer; resume with the "
                              f"same ones")
        return out

    def __enter__(self) -> "ShardReader":
        return self

    def __exit__(self, *exception) -> None:
        self.close()

    def close(self) -> None:
        """Closes every file; `with ShardReader(...)` calls it."""
        # np.load leaves a file object it was given open: the handles are closed here.
        for archive in self._files.values():
            archive.close()
        for handle in self._handles:
            handle.close()


def _unreadable(path: str, error: BaseException) -> UnreadableShards:
    return UnreadableShards(f"{os.path.basename(path)} cannot be read ({type(error).__name__}: "
                            f"{first_line(error)})")
