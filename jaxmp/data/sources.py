"""Opening a token source as random-access tokens, checked against the model's vocabulary.

Sources: ``"stdlib"`` (bytes of this Python's standard-library sources, vocab 256), a nanoGPT
``.bin`` file (flat little-endian uint16/uint32 tokens, memory-mapped; eval is its tail), a
folder written by ``jaxmp data prepare`` (``train.bin`` / ``val.bin``, dtype from
``meta.json``) or ``"synthetic"`` (counter-based random tokens for benchmarks).
"""

from __future__ import annotations

import hashlib
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from jaxmp.data.meta import BINS, COUNTS, DTYPES, read_meta
from jaxmp.data.stdlib import STDLIB_VOCAB, build_stdlib_corpus
from jaxmp.data.tokens import ArrayTokens, SyntheticTokens, Tokens, stable_hash
from jaxmp.errors import DataError

_CHECK_CHUNK = 16 * 2**20  # tokens per chunk when scanning a .bin file for its max id
_SPLITS = ("train", "eval")


@lru_cache(maxsize=32)
def _max_token(path: str, size: int, mtime_ns: int, dtype: str) -> int:
    """Largest id in a token file, scanned in chunks (cached per file version and dtype)."""
    tokens = np.memmap(path, dtype=DTYPES[dtype], mode="r")
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
    """Open one split of a source as random-access tokens, validating it against ``vocab_size``.

    For a prepared folder the dtype comes from its ``meta.json`` and ``eval_fraction`` is unused
    (``val.bin`` is the eval split).
    """
    if split not in _SPLITS:
        raise DataError(f"split must be one of {', '.join(_SPLITS)}, got {split!r}")
    if not 0.0 <= eval_fraction < 1.0:
        raise DataError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    if vocab_size < 1:
        raise DataError(f"vocab_size must be >= 1, got {vocab_size}")
    if source == "synthetic":
        return SyntheticTokens(key=stable_hash("synthetic", seed, split, bits=64),
                               vocab_size=vocab_size, fingerprint=f"synthetic:{split}:v{vocab_size}")
    if source == "stdlib":
        tokens = _open_stdlib(split, vocab_size, eval_fraction)
    elif Path(source).is_dir():
        tokens = _open_prepared(Path(source), split, vocab_size)
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
    return ArrayTokens(tokens, f"stdlib:{meta['python']}:{meta['key']}:{split}", f"stdlib {split}")


def _check_bin(path: Path, vocab_size: int, token_dtype: str) -> str:
    """Check a token file's size and ids against ``vocab_size``; returns its content digest."""
    if token_dtype not in DTYPES:
        raise DataError(f"token_dtype must be one of {', '.join(DTYPES)}, got {token_dtype!r}")
    if not path.is_file():
        raise DataError(f"data file not found: {path} (data.source is 'stdlib', 'synthetic', "
                        f"a path to a .bin token file or a folder written by `jaxmp data prepare`)")
    stat = path.stat()
    itemsize = DTYPES[token_dtype].itemsize
    if stat.st_size == 0 or stat.st_size % itemsize:
        raise DataError(f"data file {path} has {stat.st_size} bytes, not a whole positive "
                        f"number of {token_dtype} tokens")
    top = _max_token(str(path.resolve()), stat.st_size, stat.st_mtime_ns, token_dtype)
    if top >= vocab_size:
        raise DataError(f"data file {path} has token id {top} >= vocab_size {vocab_size} "
                        f"(wrong token_dtype or model.vocab_size?)")
    return _bin_digest(path, stat.st_size)


def _open_bin(path: Path, split: str, vocab_size: int, token_dtype: str,
              eval_fraction: float) -> ArrayTokens:
    """Memory-map a nanoGPT token file; eval is its last ``eval_fraction`` of the tokens."""
    digest = _check_bin(path, vocab_size, token_dtype)
    tokens = np.memmap(path, dtype=DTYPES[token_dtype], mode="r")
    n_eval = int(round(len(tokens) * eval_fraction))
    cut = len(tokens) - n_eval
    part = tokens[:cut] if split == "train" else tokens[cut:]
    return ArrayTokens(part, f"bin:{token_dtype}:{digest}:{split}:{cut}", f"{path} ({split})")


def _open_prepared(folder: Path, split: str, vocab_size: int) -> ArrayTokens:
    """Memory-map ``train.bin`` or ``val.bin`` of a ``jaxmp data prepare`` folder."""
    meta = read_meta(folder)
    if meta["vocab_size"] > vocab_size:
        raise DataError(f"model.vocab_size {vocab_size} is smaller than the tokenizer's "
                        f"{meta['vocab_size']} tokens in {folder / 'meta.json'}")
    path, dtype = folder / BINS[split], meta["dtype"]
    if meta[COUNTS[split]] < 2:
        fix = ("set train.eval_every=0 or prepare with a larger --val-fraction" if split == "eval"
               else "prepare more text")
        raise DataError(f"{path} has {meta[COUNTS[split]]} tokens, too few to use; {fix}")
    digest = _check_bin(path, vocab_size, dtype)
    return ArrayTokens(np.memmap(path, dtype=DTYPES[dtype], mode="r"),
                       f"prepared:{dtype}:{digest}:{split}", str(path))


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
