"""Atomic file writes: a reader sees the old file or the new one, never half of one."""

from __future__ import annotations

import os
import tempfile


def atomic_write_text(path: str | os.PathLike, text: str) -> str:
    """Writes `text` to `path` through a temporary file in the same folder and a rename.

    Args:
        path: The file to write; its folder is created if missing.
        text: The whole content.

    Returns:
        The path written, as a string.

    Example:

        atomic_write_text("runs/a/config.yaml", config.to_yaml())
    """
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as stream:
            stream.write(text)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise
    return path
