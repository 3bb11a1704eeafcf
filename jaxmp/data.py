"""Token streams for training: sources, deterministic global batches, per-process reading.

The stream is defined globally so a run is reproducible whatever the hardware: a source is a 1-D
token array cut into non-overlapping windows of ``seq_len + 1`` tokens (stride ``seq_len``, so an
epoch is every window once); Grain shuffles the window order per epoch from the seed; the global
batch at step ``s`` is rows ``[s*B, (s+1)*B)`` of that shuffled stream. Process ``p`` of ``P``
reads only its contiguous ``B/P`` rows, and the iterator state is just the global step, so a run
resumed on a different number of processes or devices continues the same batches.

Sources: ``"stdlib"`` (bytes of this Python's standard-library sources, no download, vocab 256),
a nanoGPT ``.bin`` file (flat little-endian uint16/uint32 tokens, memory-mapped) or
``"synthetic"`` (counter-based random tokens for benchmarks).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sysconfig
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator

import grain
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxmp._util.io import atomic_write
from jaxmp.errors import DataError

SEPARATOR = 0  # byte written after every stdlib file: a document boundary the model can learn
STDLIB_VOCAB = 256
SYNTHETIC_TOKENS = 2**30  # virtual length of the synthetic stream (never materialised)
_CHECK_CHUNK = 16 * 2**20  # tokens per chunk when scanning a .bin file for its max id
_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
_SPLITS = ("train", "eval")
_STATE_KEYS = ("seed", "global_batch", "seq_len", "fingerprint")


# ----------------------------------------------------------------------------------- sources


@dataclass(frozen=True)
class ArrayTokens:
    """A 1-D token array (usually a read-only memmap) with a fingerprint naming its content."""

    tokens: np.ndarray
    fingerprint: str

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.shape[0])

    def gather(self, starts: np.ndarray, length: int) -> np.ndarray:
        """Rows ``tokens[start:start+length]``; fancy indexing reads only the pages it touches."""
        return np.asarray(self.tokens[starts[:, None] + np.arange(length)], dtype=np.int32)


@dataclass(frozen=True)
class SyntheticTokens:
    """Random tokens defined by a hash of (key, position): random access, nothing stored."""

    key: int
    vocab_size: int
    fingerprint: str
    n_tokens: int = SYNTHETIC_TOKENS

    def gather(self, starts: np.ndarray, length: int) -> np.ndarray:
        pos = (starts[:, None] + np.arange(length)).astype(np.uint64)
        return (_splitmix64(pos ^ np.uint64(self.key)) % np.uint64(self.vocab_size)).astype(np.int32)


Tokens = ArrayTokens | SyntheticTokens


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser: a cheap, well-mixed bijection on uint64 (wraps on purpose)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _hash(*parts: object, bits: int = 32) -> int:
    """A stable hash (Python's ``hash`` is salted per process, so unusable here)."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=bits // 8).digest()
    return int.from_bytes(digest, "little")


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
    for name, size in sorted(files, key=lambda f: (_hash("eval", f[0]), f[0])):
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


@lru_cache(maxsize=32)
def _max_token(path: str, size: int, mtime_ns: int, dtype: str) -> int:
    """Largest id in a token file, scanned in chunks (cached per file version and dtype)."""
    tokens = np.memmap(path, dtype=_DTYPES[dtype], mode="r")
    return max((int(tokens[i:i + _CHECK_CHUNK].max()) for i in range(0, len(tokens), _CHECK_CHUNK)),
               default=0)


def _bin_digest(path: Path, size: int) -> str:
    """Content fingerprint from the size and first/last MiB: stable across copies and moves."""
    with open(path, "rb") as f:
        head = f.read(2**20)
        f.seek(max(0, size - 2**20))
        tail = f.read()
    return hashlib.blake2b(head + tail + str(size).encode(), digest_size=8).hexdigest()


def open_tokens(source: str, *, split: str = "train", vocab_size: int, seed: int = 0,
                token_dtype: str = "uint16", eval_fraction: float = 0.01) -> Tokens:
    """Open one split of a source as random-access tokens, validating it against ``vocab_size``."""
    if split not in _SPLITS:
        raise DataError(f"split must be one of {', '.join(_SPLITS)}, got {split!r}")
    if not 0.0 <= eval_fraction < 1.0:
        raise DataError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    if vocab_size < 1:
        raise DataError(f"vocab_size must be >= 1, got {vocab_size}")
    if source == "synthetic":
        return SyntheticTokens(key=_hash("synthetic", seed, split, bits=64),
                               vocab_size=vocab_size, fingerprint=f"synthetic:{split}:v{vocab_size}")
    if source == "stdlib":
        tokens = _open_stdlib(split, vocab_size, eval_fraction)
    else:
        tokens = _open_bin(Path(source), split, vocab_size, token_dtype, eval_fraction)
    if tokens.n_tokens < 2:
        raise DataError(f"the {split} split of {source} has {tokens.n_tokens} tokens "
                        f"(eval_fraction={eval_fraction}); it needs at least 2")
    return tokens


def _open_stdlib(split: str, vocab_size: int, eval_fraction: float) -> ArrayTokens:
    """Memory-map one split of the cached stdlib corpus (train bytes come first)."""
    if vocab_size < STDLIB_VOCAB:
        raise DataError(f"data.source 'stdlib' is byte-level and needs vocab_size >= "
                        f"{STDLIB_VOCAB}, got {vocab_size}")
    path, meta = build_stdlib_corpus(eval_fraction)
    everything = np.memmap(path, dtype=np.uint8, mode="r")
    n_train = meta["train_bytes"]
    tokens = everything[:n_train] if split == "train" else everything[n_train:]
    return ArrayTokens(tokens, f"stdlib:{meta['python']}:{meta['key']}:{split}")


def _open_bin(path: Path, split: str, vocab_size: int, token_dtype: str,
              eval_fraction: float) -> ArrayTokens:
    """Memory-map a nanoGPT token file; eval is its last ``eval_fraction`` of the tokens."""
    if token_dtype not in _DTYPES:
        raise DataError(f"token_dtype must be one of {', '.join(_DTYPES)}, got {token_dtype!r}")
    if not path.is_file():
        raise DataError(f"data file not found: {path} (data.source is 'stdlib', 'synthetic' "
                        f"or a path to a .bin token file)")
    stat = path.stat()
    itemsize = _DTYPES[token_dtype].itemsize
    if stat.st_size == 0 or stat.st_size % itemsize:
        raise DataError(f"data file {path} has {stat.st_size} bytes, not a whole positive "
                        f"number of {token_dtype} tokens")
    top = _max_token(str(path.resolve()), stat.st_size, stat.st_mtime_ns, token_dtype)
    if top >= vocab_size:
        raise DataError(f"data file {path} has token id {top} >= vocab_size {vocab_size} "
                        f"(wrong token_dtype or model.vocab_size?)")
    tokens = np.memmap(path, dtype=_DTYPES[token_dtype], mode="r")
    n_eval = int(round(len(tokens) * eval_fraction))
    cut = len(tokens) - n_eval
    part = tokens[:cut] if split == "train" else tokens[cut:]
    digest = _bin_digest(path, stat.st_size)
    return ArrayTokens(part, f"bin:{token_dtype}:{digest}:{split}:{cut}")


def corpus_info(source: str, *, split: str = "train", vocab_size: int = STDLIB_VOCAB,
                token_dtype: str = "uint16", eval_fraction: float = 0.01) -> dict[str, Any]:
    """Token count, bytes on disk and (for stdlib) file count of one split, for run logs."""
    tokens = open_tokens(source, split=split, vocab_size=vocab_size, token_dtype=token_dtype,
                         eval_fraction=eval_fraction)
    info: dict[str, Any] = {"source": source, "split": split, "tokens": tokens.n_tokens,
                            "fingerprint": tokens.fingerprint}
    if isinstance(tokens, ArrayTokens):
        info["bytes"] = int(tokens.tokens.nbytes)
    if source == "stdlib":
        info["files"] = len(build_stdlib_corpus(eval_fraction)[1][f"{split}_files"])
    return info


# ----------------------------------------------------------------------------------- batches


class BatchIterator:
    """This process's rows of the global batch stream; state is the global step only.

    ``__next__`` returns ``{"inputs", "targets"}`` as ``int32[global_batch / process_count,
    seq_len]``; ``targets`` are ``inputs`` shifted by one token.
    """

    def __init__(self, tokens: Tokens, *, seq_len: int, global_batch: int, seed: int,
                 process_index: int, process_count: int) -> None:
        if seq_len < 1 or global_batch < 1:
            raise DataError(f"seq_len and global_batch must be >= 1, got {seq_len}, {global_batch}")
        if process_count < 1 or not 0 <= process_index < process_count:
            raise DataError(f"process_index {process_index} is not in [0, {process_count})")
        if global_batch % process_count:
            raise DataError(f"global batch {global_batch} is not divisible by the process count "
                            f"{process_count}; every process must read the same number of rows")
        self.n_windows = (tokens.n_tokens - 1) // seq_len
        if self.n_windows < 1:
            raise DataError(f"source {tokens.fingerprint} has {tokens.n_tokens} tokens, fewer "
                            f"than one window of seq_len + 1 = {seq_len + 1}")
        self.tokens, self.seq_len, self.global_batch, self.seed = tokens, seq_len, global_batch, seed
        self.process_index, self.process_count = process_index, process_count
        self.local_batch = global_batch // process_count
        self.step = 0
        # Hash the user seed: Grain reseeds epoch e with seed + e, so raw seeds s and s+1 would
        # give the same permutations shifted by one epoch.
        self._order = grain.MapDataset.range(self.n_windows).shuffle(
            seed=_hash("jaxmp-shuffle", seed)).repeat()

    def __iter__(self) -> BatchIterator:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        first = self.step * self.global_batch + self.process_index * self.local_batch
        windows = np.fromiter((self._order[i] for i in range(first, first + self.local_batch)),
                              dtype=np.int64, count=self.local_batch)
        rows = self.tokens.gather(windows * self.seq_len, self.seq_len + 1)
        self.step += 1
        return {"inputs": rows[:, :-1], "targets": rows[:, 1:]}

    def get_state(self) -> dict[str, Any]:
        """JSON-able: the next global step and what identifies the stream (no process layout)."""
        return {"step": self.step, "seed": self.seed, "global_batch": self.global_batch,
                "seq_len": self.seq_len, "fingerprint": self.tokens.fingerprint}

    def set_state(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; refuses a state from a different stream."""
        mine = self.get_state()
        for key in _STATE_KEYS:
            if state.get(key) != mine[key]:
                raise DataError(f"data state does not match this stream: {key} is "
                                f"{state.get(key)!r} in the state but {mine[key]!r} here")
        step = state.get("step")
        if not isinstance(step, int) or step < 0:
            raise DataError(f"data state step must be a non-negative integer, got {step!r}")
        self.step = step


def make_batches(source: str, *, seq_len: int, global_batch: int, seed: int, vocab_size: int,
                 split: str = "train", token_dtype: str = "uint16", eval_fraction: float = 0.01,
                 process_index: int | None = None, process_count: int | None = None,
                 ) -> BatchIterator:
    """The batch iterator for ``source`` ('stdlib', 'synthetic' or a .bin path) on this process."""
    tokens = open_tokens(source, split=split, vocab_size=vocab_size, seed=seed,
                         token_dtype=token_dtype, eval_fraction=eval_fraction)
    return BatchIterator(
        tokens, seq_len=seq_len, global_batch=global_batch, seed=seed,
        process_index=jax.process_index() if process_index is None else process_index,
        process_count=jax.process_count() if process_count is None else process_count)


def to_global(batch: dict[str, np.ndarray], mesh: Mesh,
              spec: PartitionSpec = PartitionSpec(("data", "fsdp"))) -> dict[str, jax.Array]:
    """Assemble global arrays from every process's local rows (``BatchIterator`` output).

    The local rows must be the devices' contiguous slice of the global batch, process ``p``
    holding rows ``[p*n, (p+1)*n)``: true for ``jaxmp.make_mesh`` meshes, whose batch axes are
    outermost and span hosts first. Mesh axes not in ``spec`` (e.g. ``tensor``) replicate the
    batch. A layout that breaks this raises instead of silently training on wrong rows.
    """
    sharding = NamedSharding(mesh, spec)
    batch_axes = spec[0] if spec and spec[0] is not None else ()
    shards = int(np.prod([mesh.shape[a] for a in np.atleast_1d(batch_axes)]))
    p, n_proc = jax.process_index(), jax.process_count()
    if n_proc == 1:  # the local rows are the global batch: one transfer call for all arrays
        for name, local in batch.items():
            if local.shape[0] % shards:
                raise DataError(f"global batch {local.shape[0]} is not divisible by the "
                                f"{shards} batch shards of mesh axes {batch_axes}")
        return jax.device_put(batch, sharding)
    out = {}
    for name, local in batch.items():
        n = local.shape[0]
        global_shape = (n * n_proc, *local.shape[1:])
        if global_shape[0] % shards:
            raise DataError(f"global batch {global_shape[0]} is not divisible by the {shards} "
                            f"batch shards of mesh axes {batch_axes}")
        rows = [idx[0] for idx in sharding.addressable_devices_indices_map(global_shape).values()]
        lo = min(r.start or 0 for r in rows)
        hi = max(global_shape[0] if r.stop is None else r.stop for r in rows)
        if (lo, hi) != (p * n, (p + 1) * n):
            raise DataError(f"process {p}'s devices need batch rows [{lo}, {hi}) but it read "
                            f"[{p * n}, {(p + 1) * n}): the batch axes {batch_axes} must split the "
                            f"batch across processes, in process order")
        out[name] = jax.make_array_from_process_local_data(sharding, local, global_shape)
    return out
