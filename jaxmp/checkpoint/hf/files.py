"""Reading a Hugging Face weights folder: ``model.safetensors`` or the shards its
``model.safetensors.index.json`` lists, one tensor at a time.

A safetensors file is an 8-byte little-endian header length, a JSON header (per tensor:
dtype, shape, byte offsets into the data section) and the raw little-endian data. That is
simple enough to read here rather than depend on the ``safetensors`` package: the header is
checked field by field (a checkpoint is data, never trusted code), and each tensor is
memory-mapped alone, for as long as a view of it lives, so the pages it touched leave the
process again once it is used — reading a whole model never makes the process hold more
than one tensor of it. bfloat16 comes through ``ml_dtypes`` (what jax uses).
"""

from __future__ import annotations

import json
import math
import mmap
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from jaxmp.errors import CheckpointError

SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"
DTYPES: dict[str, np.dtype] = {
    "BF16": np.dtype(ml_dtypes.bfloat16), "F16": np.dtype("<f2"), "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"), "I8": np.dtype("i1"), "U8": np.dtype("u1"), "I16": np.dtype("<i2"),
    "I32": np.dtype("<i4"), "I64": np.dtype("<i8"), "BOOL": np.dtype("?")}
MAX_HEADER = 100 * 2**20  # a header this large is damage, not a model


@dataclass(frozen=True)
class Tensor:
    """Where one tensor's bytes are: file, absolute byte offset, dtype and shape."""

    name: str
    file: Path
    offset: int
    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def read_header(path: Path) -> dict[str, Tensor]:
    """The tensors of one ``.safetensors`` file, checked against the file's size."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 2 <= n <= min(MAX_HEADER, size - 8):
                raise CheckpointError(f"{path}: not a safetensors file (header length {n}, "
                                      f"file size {size})")
            header = json.loads(f.read(n))
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e.strerror or e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not a safetensors file (header: {e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: not a safetensors file (header is not a JSON object)")
    start, out = 8 + n, {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        out[name] = _tensor(path, name, entry, start, size)
    return out


def _tensor(path: Path, name: str, entry: Any, start: int, size: int) -> Tensor:
    where = f"{path}: tensor {name}"
    if not isinstance(entry, dict):
        raise CheckpointError(f"{where}: header entry is not a JSON object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPES:
        raise CheckpointError(f"{where}: dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    ints = lambda x, n=None: (isinstance(x, list) and (n is None or len(x) == n) and  # noqa: E731
                              all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                  for d in x))
    if not ints(shape) or not ints(offsets, 2):
        raise CheckpointError(f"{where}: shape {shape!r} / data_offsets {offsets!r} are not "
                              f"lists of sizes")
    begin, end = offsets
    want = math.prod(shape) * DTYPES[dtype].itemsize
    if end - begin != want or start + end > size:
        raise CheckpointError(f"{where}: data_offsets {offsets} do not hold {dtype}{shape} "
                              f"({want} bytes) inside the file ({size} bytes)")
    return Tensor(name, path, start + begin, DTYPES[dtype], tuple(shape))


def _index(folder: Path) -> dict[str, str]:
    """``{tensor name: shard file name}`` from the folder's index (CheckpointError if bad)."""
    path = folder / INDEX
    try:
        index = json.loads(path.read_text())
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e.strerror or e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not a JSON index: {e}") from None
    weights = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weights, dict) or not weights:
        raise CheckpointError(f"{path}: has no weight_map table of tensor -> file")
    for name, file in weights.items():
        if not (isinstance(file, str) and file.endswith(".safetensors")
                and file == os.path.basename(file) and file not in (".", "..")):
            raise CheckpointError(f"{path}: tensor {name} maps to {file!r}, expected a "
                                  f".safetensors file name in the same folder")
    return weights


class Weights(Mapping[str, Tensor]):
    """The tensors of a Hugging Face folder by name (a mapping of :class:`Tensor`)."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        if (self.folder / SINGLE).is_file():
            self.files = [self.folder / SINGLE]
            self._tensors = read_header(self.files[0])
            return
        if not (self.folder / INDEX).is_file():
            found = sorted(p.name for p in self.folder.glob("*.bin"))
            hint = f" ({found[0]} is PyTorch pickle, which jaxmp does not read: convert it " \
                   f"to safetensors)" if found else ""
            raise CheckpointError(f"{self.folder}: has no {SINGLE} or {INDEX}{hint}")
        weights = _index(self.folder)
        self.files = [self.folder / f for f in sorted(set(weights.values()))]
        headers = {}
        for path in self.files:
            if not path.is_file():
                raise CheckpointError(f"{self.folder / INDEX}: lists {path.name}, which is "
                                      f"not in {self.folder}")
            headers[path.name] = read_header(path)
        self._tensors = {}
        for name, file in weights.items():
            if name not in headers[file]:
                raise CheckpointError(f"{self.folder / INDEX}: tensor {name} is not in {file}")
            self._tensors[name] = headers[file][name]

    def __getitem__(self, name: str) -> Tensor:
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self._tensors.values())


def mapped(tensor: Tensor) -> np.ndarray:
    """The tensor as a read-only array backed by the file: only the pages a slice touches
    are read, and the mapping is gone once this array and every view of it are (so keep
    copies, not views, of what you need)."""
    if tensor.nbytes == 0:
        return np.zeros(tensor.shape, tensor.dtype)
    start = tensor.offset - tensor.offset % mmap.ALLOCATIONGRANULARITY
    with tensor.file.open("rb") as f:
        mm = mmap.mmap(f.fileno(), tensor.offset + tensor.nbytes - start,
                       access=mmap.ACCESS_READ, offset=start)
    return np.frombuffer(mm, tensor.dtype, math.prod(tensor.shape),
                         tensor.offset - start).reshape(tensor.shape)
