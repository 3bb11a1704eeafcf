"""The built-in corpus: this Python's standard-library sources as bytes (no download, vocab 256).

Built once into a cache file (train files, then held-out eval files, each followed by
``SEPARATOR``) and memory-mapped from there by :func:`jaxmp.data.sources.open_tokens`.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sysconfig
from pathlib import Path
from typing import Any, Iterator

from jaxmp._util.io import atomic_write
from jaxmp.data.tokens import stable_hash

SEPARATOR = 0  # byte written after every stdlib file: a document boundary the model can learn
STDLIB_VOCAB = 256


def cache_dir() -> Path:
    """``$JAXMP_CACHE`` or ``~/.cache/jaxmp``: where built corpora live between runs."""
    return Path(os.environ.get("JAXMP_CACHE") or Path.home() / ".cache" / "jaxmp")


def stdlib_files() -> list[tuple[str, int]]:
    """(relative path, size) of every stdlib ``.py`` file, sorted, skipping site-packages."""
    root = sysconfig.get_paths()["stdlib"]
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d != "site-packages"]
        for name in files:
            if name.endswith(".py"):
                full = os.path.join(folder, name)
                found.append((os.path.relpath(full, root).replace(os.sep, "/"), os.path.getsize(full)))
    return sorted(found)


def split_files(files: list[tuple[str, int]], eval_fraction: float) -> tuple[list[str], list[str]]:
    """Split files into (train, eval) names, both in sorted order.

    Files are taken in order of a hash of their path until ``eval_fraction`` of the bytes is held
    out: membership depends only on names and sizes (same on every host), the eval share is
    close to the requested one in bytes, and whole files stay on one side so no code leaks.
    """
    total, held, chosen = sum(s for _, s in files), 0, set()
    for name, size in sorted(files, key=lambda f: (stable_hash("eval", f[0]), f[0])):
        if held >= eval_fraction * total:
            break
        chosen.add(name)
        held += size
    return [n for n, _ in files if n not in chosen], [n for n, _ in files if n in chosen]


def build_stdlib_corpus(eval_fraction: float) -> tuple[Path, dict[str, Any]]:
    """Build (or find cached) the stdlib byte corpus; returns (raw uint8 file, metadata).

    The file holds the train files then the eval files, each followed by ``SEPARATOR``; the
    cache key covers the Python version, the file list with sizes and the eval fraction.
    """
    files = stdlib_files()
    version = f"{platform.python_implementation().lower()}{platform.python_version()}"
    listing = "\n".join(f"{n}\t{s}" for n, s in files)
    key = hashlib.sha256(f"{version}\n{eval_fraction!r}\n{listing}".encode()).hexdigest()[:16]
    folder = cache_dir()
    corpus, meta_path = folder / f"stdlib-{version}-{key}.u8", folder / f"stdlib-{version}-{key}.json"
    if meta_path.exists() and corpus.exists():
        meta = json.loads(meta_path.read_text())
        if corpus.stat().st_size == meta["train_bytes"] + meta["eval_bytes"]:
            return corpus, meta
    folder.mkdir(parents=True, exist_ok=True)
    train, held = split_files(files, eval_fraction)
    root = Path(sysconfig.get_paths()["stdlib"])
    sizes: dict[str, int] = {}

    def chunks() -> Iterator[bytes]:
        for name in train + held:
            body = (root / name).read_bytes() + bytes([SEPARATOR])
            sizes[name] = len(body)
            yield body

    atomic_write(corpus, chunks())
    meta = {"key": key, "python": version, "eval_fraction": eval_fraction,
            "train_files": train, "eval_files": held,
            "train_bytes": sum(sizes[n] for n in train), "eval_bytes": sum(sizes[n] for n in held)}
    atomic_write(meta_path, json.dumps(meta))
    return corpus, meta
