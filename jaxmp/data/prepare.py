"""``jaxmp data prepare``: text files → ``train.bin``, ``val.bin``, ``tokenizer.json``, ``meta.json``.

Streaming: files are read in pieces of whole lines (``PIECE`` bytes), so memory stays flat
whatever the corpus size (a BPE trainer's memory grows with the number of distinct words, not
with the bytes). Each file gives its first ``1 - val_fraction`` of bytes to ``train.bin`` and the
rest — from the first line start in that tail, if the file has one — to ``val.bin``; each part is
followed by the tokenizer's end-of-text id, so documents stay apart. Text is encoded with
``encode_batch`` (Rust threads on every core) ``BATCH`` bytes at a time; ``bytes`` needs no
encoding at all. Everything is written to temporary files and renamed at the end, ``meta.json``
last: an interrupted run never leaves a folder that looks complete.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from rich.console import Console
from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                           TransferSpeedColumn)

from jaxmp._util.io import atomic_write
from jaxmp.data.meta import BINS, DTYPES, FORMAT, META, TOKENIZER, dtype_for
from jaxmp.data.stdlib import SEPARATOR
from jaxmp.data.tokenizer import (BYTE_VOCAB, TokenizerSpec, byte_tokenizer, end_token,
                                  load_tokenizer, parse_spec, train_bpe)
from jaxmp.errors import DataError, UsageError

PIECE = 64 * 2**10  # bytes read at a time (cut back to the last line end)
MAX_LINE = 2**20  # a line longer than this is cut at a UTF-8 character boundary
BATCH = 8 * 2**20  # bytes of text per encode_batch call


@dataclass(frozen=True)
class SourceFile:
    path: Path
    size: int


def find_inputs(inputs: Sequence[str]) -> list[SourceFile]:
    """Files named by ``inputs`` (files, folders searched recursively, glob patterns), in order.

    Under a folder, hidden entries and binary files (a NUL byte in the first 8 KiB, git's test)
    are skipped; a file named twice is read once.
    DataError for an input that names nothing, an unreadable file, or no bytes at all.
    """
    found: dict[Path, None] = {}
    for text in inputs:
        path = Path(text)
        if path.is_dir():
            matches = sorted(p for p in path.rglob("*") if p.is_file() and not any(
                part.startswith(".") for part in p.relative_to(path).parts) and _is_text(p))
        elif path.is_file():
            matches = [path]
        elif glob.has_magic(text):
            matches = sorted(Path(p) for p in glob.glob(text, recursive=True) if Path(p).is_file())
        else:
            raise DataError(f"input {text}: no such file or folder")
        if not matches:
            raise DataError(f"input {text}: matches no files")
        found.update(dict.fromkeys(matches))
    files = []
    for path in found:
        try:
            with open(path, "rb"):
                pass
        except OSError as e:
            raise DataError(f"input {path}: cannot read: {e.strerror}") from None
        files.append(SourceFile(path, path.stat().st_size))
    if not any(f.size for f in files):
        raise DataError(f"the input is empty: {len(files)} file(s), 0 bytes "
                        f"({', '.join(map(str, inputs))[:200]})")
    return files


def _is_text(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return b"\0" not in f.read(8192)
    except OSError:
        return True  # kept, so that reading it reports the error


def _char_start(data: bytes, i: int) -> int:
    """``i`` moved back to the start of a UTF-8 character."""
    while 0 < i < len(data) and data[i] & 0xC0 == 0x80:
        i -= 1
    return i


def _val_start(piece: bytes, rel: int, final: bool) -> int:
    """Where the held-out tail starts in ``piece`` when the cut falls at ``rel``: the next line
    start, or ``rel`` itself (at a character start) if the file has no line start left."""
    nl = piece.find(b"\n", max(rel - 1, 0))
    if nl != -1 and (nl + 1 < len(piece) or not final):
        return nl + 1
    return _char_start(piece, rel)


def pieces(src: SourceFile, val_fraction: float,
           hasher: Any = None) -> Iterator[tuple[str, int, bytes]]:
    """``(split, offset, bytes)`` pieces of whole lines of one file, train part first."""
    cut = src.size - int(src.size * val_fraction)
    offset, carry, split = 0, b"", "train"
    with open(src.path, "rb") as f:
        while True:
            block = f.read(PIECE)
            if hasher is not None:
                hasher.update(block)
            data = carry + block
            if not data:
                return
            end = data.rfind(b"\n") + 1 if block else len(data)
            if end == 0:
                if len(data) < MAX_LINE:
                    carry = data
                    continue
                end = _char_start(data, len(data) - 1)
            piece, carry = data[:end], data[end:]
            if split == "train" and offset + len(piece) > cut:
                at = _val_start(piece, cut - offset, final=offset + len(piece) >= src.size)
                if at:
                    yield "train", offset, piece[:at]
                piece, offset, split = piece[at:], offset + at, "eval"
            if piece:
                yield split, offset, piece
            offset += len(piece)


def _text(src: SourceFile, offset: int, piece: bytes) -> str:
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"input {src.path}: not UTF-8 text at byte {offset + e.start} "
                        f"(--tokenizer bytes reads any bytes)") from None


class _TempBin:
    """A token file written to a temporary name beside its destination, renamed on commit."""

    def __init__(self, dest: Path, dtype: np.dtype):
        self.dest, self.dtype, self.count = dest, dtype, 0
        fd, self.tmp = tempfile.mkstemp(dir=dest.parent, prefix=dest.name + ".", suffix=".tmp")
        self.file: BinaryIO = os.fdopen(fd, "wb")

    def write(self, ids: Any) -> None:
        arr = np.asarray(ids, dtype=self.dtype)
        arr.tofile(self.file)
        self.count += arr.size

    def commit(self) -> None:
        self.file.close()
        os.replace(self.tmp, self.dest)

    def discard(self) -> None:
        self.file.close()
        Path(self.tmp).unlink(missing_ok=True)


def _progress(enabled: bool) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                    TransferSpeedColumn(), TimeRemainingColumn(),
                    console=Console(stderr=True), disable=not enabled)


def _choose_dtype(vocab: int, dtype: str, what: str) -> str:
    if dtype == "auto":
        return dtype_for(vocab)
    if dtype_for(vocab) == "uint32" and dtype == "uint16":
        raise DataError(f"--dtype uint16 cannot hold the ids of {what} ({vocab} tokens > 65536); "
                        f"use --dtype uint32 or auto")
    return dtype


def prepare(inputs: Sequence[str], out: str | os.PathLike, tokenizer: str = "bytes",
            val_fraction: float = 0.01, dtype: str = "auto", progress: bool = False,
            ) -> dict[str, Any]:
    """Tokenize ``inputs`` into the folder ``out``; returns what ``meta.json`` holds."""
    start = time.perf_counter()
    if not 0.0 <= val_fraction < 1.0:
        raise UsageError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    if dtype not in ("auto", *DTYPES):
        raise UsageError(f"--dtype must be auto, uint16 or uint32, got {dtype!r}")
    spec = parse_spec(tokenizer)
    if spec.kind == "bpe":  # fail before a long training
        _choose_dtype(spec.size, dtype, f"--tokenizer {spec.name}")
    files = find_inputs(inputs)
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out}: exists and is not a folder")
    out.mkdir(parents=True, exist_ok=True)
    total = sum(f.size for f in files)
    with _progress(progress) as bar:
        tok = _tokenizer(spec, files, val_fraction, bar, total)
        vocab = tok.get_vocab_size(with_added_tokens=True)
        token_dtype = _choose_dtype(vocab, dtype, f"tokenizer {spec.name}")
        separator = SEPARATOR if spec.kind == "bytes" else end_token(tok)
        writers = {split: _TempBin(out / name, DTYPES[token_dtype]) for split, name in BINS.items()}
        try:
            task = bar.add_task("tokenizing", total=total)
            hashes = _write_tokens(files, val_fraction, None if spec.kind == "bytes" else tok,
                                   separator, writers, lambda n: bar.advance(task, n))
            (out / META).unlink(missing_ok=True)  # the old folder stops looking complete
            for w in writers.values():
                w.commit()
        except BaseException:
            for w in writers.values():
                w.discard()
            raise
    atomic_write(out / TOKENIZER, tok.to_str())
    meta = {"format": FORMAT, "tokenizer": spec.name, "vocab_size": vocab, "dtype": token_dtype,
            "separator": None if separator is None else
            {"id": separator, "text": tok.id_to_token(separator) if spec.kind != "bytes" else "\0"},
            "train_tokens": writers["train"].count, "val_tokens": writers["eval"].count,
            "val_fraction": val_fraction, "bytes": total, "seconds": 0.0,
            "sources": [{"path": str(f.path), "bytes": f.size, "sha256": h}
                        for f, h in zip(files, hashes)]}
    meta["seconds"] = round(time.perf_counter() - start, 3)
    atomic_write(out / META, json.dumps(meta, indent=1) + "\n")
    return meta


def _tokenizer(spec: TokenizerSpec, files: list[SourceFile], val_fraction: float,
               bar: Progress, total: int) -> Any:
    if spec.kind == "bytes":
        return byte_tokenizer()
    if spec.kind == "file":
        return load_tokenizer(spec.path)
    task = bar.add_task(f"training {spec.name}", total=total)

    def texts() -> Iterator[str]:  # the train parts only: val.bin stays unseen
        for src in files:
            for split, offset, piece in pieces(src, val_fraction):
                bar.advance(task, len(piece))
                if split == "train":
                    yield _text(src, offset, piece)

    return train_bpe(texts(), spec.size)


class _Encoder:
    """Tokens of text pieces, in order, into the split's writer: batched through the tokenizer's
    ``encode_batch`` (Rust threads), or straight through for raw bytes (``tok`` None)."""

    def __init__(self, tok: Any, separator: int | None, writers: dict[str, _TempBin]):
        self.tok, self.separator, self.writers = tok, separator, writers
        self.encode = tok and (getattr(tok, "encode_batch_fast", None) or tok.encode_batch)
        self.pending: list[tuple[str, str | None]] = []  # (split, text); None: a separator
        self.size = 0

    def add(self, split: str, src: SourceFile, offset: int, piece: bytes) -> None:
        if self.tok is None:
            self.writers[split].write(np.frombuffer(piece, np.uint8))
            return
        self.pending.append((split, _text(src, offset, piece)))
        self.size += len(piece)
        if self.size >= BATCH:
            self.flush()

    def end_document(self, split: str) -> None:
        if self.separator is None:
            return
        if self.tok is None:
            self.writers[split].write([self.separator])
        else:
            self.pending.append((split, None))

    def flush(self) -> None:
        if not self.pending:
            return
        texts = [t for _, t in self.pending if t is not None]
        encoded = iter(self.encode(texts, add_special_tokens=False))
        for split, text in self.pending:
            self.writers[split].write([self.separator] if text is None else next(encoded).ids)
        self.pending, self.size = [], 0


def _write_tokens(files: list[SourceFile], val_fraction: float, tok: Any, separator: int | None,
                  writers: dict[str, _TempBin], advance: Any) -> list[str]:
    """Stream every file through the tokenizer (None: raw bytes) into ``writers``; sha256s."""
    encoder, hashes = _Encoder(tok, separator, writers), []
    for src in files:
        hasher, last = hashlib.sha256(), None
        for split, offset, piece in pieces(src, val_fraction, hasher):
            if last not in (None, split):
                encoder.end_document(last)
            last = split
            encoder.add(split, src, offset, piece)
            advance(len(piece))
        if last is not None:
            encoder.end_document(last)
        hashes.append(hasher.hexdigest())
    encoder.flush()
    return hashes
