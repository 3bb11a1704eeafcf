"""Atomic file writes: a reader (or a crash) never sees half a file."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from pathlib import Path


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
