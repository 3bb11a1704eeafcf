"""Atomic file writes: a reader (or a crash) never sees half a file."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

from jaxmp.errors import RunDirError


def atomic_write(path: str | os.PathLike, data: str | bytes | Iterable[bytes]) -> Path:
    """Write ``data`` to a temporary file beside ``path``, then rename it over ``path``.

    ``data`` is text (UTF-8), bytes, or an iterable of byte chunks (streamed, for big files).
    On any error the temporary file is removed and ``path`` is left as it was.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            if isinstance(data, str):
                f.write(data.encode("utf-8"))
            elif isinstance(data, (bytes, bytearray)):
                f.write(data)
            else:
                f.writelines(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def make_dir(path: str | os.PathLike, what: str = "directory") -> Path:
    """Create ``path`` (and its parents) and check that files can be written in it.

    Anything in the way — a file where a folder should be, no permission, a read-only or full
    disk — is a :class:`~jaxmp.errors.RunDirError` naming the path, before any work starts.
    """
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path, prefix=".jaxmp-write-test-")
        os.close(fd)
        os.unlink(probe)
    except (FileExistsError, NotADirectoryError):
        blocker = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), path)
        raise RunDirError(f"{what} {path} cannot be created: {blocker} is a file") from None
    except OSError as e:
        where = f" ({e.filename})" if e.filename and str(e.filename) != str(path) else ""
        raise RunDirError(f"{what} {path} cannot be created or written: "
                          f"{e.strerror or e}{where}") from None
    return path
