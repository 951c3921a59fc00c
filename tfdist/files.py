"""Files a run writes: atomic writes (a reader sees the old file or the new one, never half
of one), and folders checked writable before a run starts rather than at its end."""

from __future__ import annotations

import os
import tempfile

from tfdist.errors import ConfigError


def writable_folder(path: str | os.PathLike, key: str) -> str:
    """Creates `path` if missing and checks that this process can write files in it.

    Args:
        path: The folder.
        key: The config key or argument that named it, for the message.

    Returns:
        The path, as a string.

    Raises:
        ConfigError: it cannot be created, is not a folder, or a file cannot be
            written in it; one line naming the key.

    Example:

        writable_folder(config.train.output_dir, "train.output_dir")
    """
    path = os.fspath(path)
    try:
        os.makedirs(path, exist_ok=True)
        # Writing a file is the only test that holds on every file system (os.access
        # ignores ACLs, read-only mounts and NFS root squashing).
        handle, probe = tempfile.mkstemp(dir=path, prefix=".tfdist-writable-")
        os.close(handle)
        os.unlink(probe)
    except OSError as error:
        raise ConfigError(f"{key} {path} is not a folder this process can write in "
                          f"({error.strerror or error}); choose another. "
                          f"Received: {key}={path!r}") from None
    return path


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
