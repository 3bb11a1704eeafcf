"""The layout of a folder written by ``jaxmp data prepare``, and reading its ``meta.json``.

A prepared folder holds ``train.bin`` and ``val.bin`` (flat little-endian token ids, the nanoGPT
layout), ``tokenizer.json`` (Hugging Face ``tokenizers``) and ``meta.json``, written last: a
folder without it is incomplete. Training reads the vocabulary size and the token dtype from
``meta.json`` (see :func:`jaxmp.recipes.gpt.resolve_data`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from jaxmp.errors import DataError

FORMAT = "jaxmp.prepared/1"
META, TOKENIZER = "meta.json", "tokenizer.json"
RUN_META = "data_meta.json"  # a run directory's copy of its prepared folder's meta.json
BINS = {"train": "train.bin", "eval": "val.bin"}  # the data splits' files
COUNTS = {"train": "train_tokens", "eval": "val_tokens"}  # their token counts in meta.json
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
VOCAB_MULTIPLE = 64  # an unspecified model.vocab_size is the tokenizer's, rounded up to this


def dtype_for(vocab_size: int) -> str:
    """The narrowest token dtype that holds ids ``0 .. vocab_size - 1``."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


def padded_vocab(vocab_size: int, multiple: int = VOCAB_MULTIPLE) -> int:
    """``vocab_size`` rounded up to a multiple of ``multiple`` (even matmul tiles and shards)."""
    return multiple * math.ceil(vocab_size / multiple)




def read_meta(folder: str | Path) -> dict[str, Any]:
    """``meta.json`` of a prepared folder, checked against its ``.bin`` files (DataError if not)."""
    folder = Path(folder)
    path = folder / META
    if not path.is_file():
        raise DataError(f"{folder} has no {META}: not a folder written by `jaxmp data prepare` "
                        f"(or the preparation did not finish)")
    try:
        meta = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{path}: cannot read: {' '.join(str(e).split())}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        got = meta.get("format") if isinstance(meta, dict) else None
        raise DataError(f"{path}: format {got!r}, expected {FORMAT!r}")
    if meta.get("dtype") not in DTYPES or not isinstance(meta.get("vocab_size"), int):
        raise DataError(f"{path}: needs an integer vocab_size and a dtype in {', '.join(DTYPES)}")
    itemsize = DTYPES[meta["dtype"]].itemsize
    for split, name in BINS.items():
        count = meta.get(COUNTS[split])
        size = (folder / name).stat().st_size if (folder / name).is_file() else None
        if size != (count or 0) * itemsize:
            raise DataError(f"{folder / name} has {size} bytes but {META} says "
                            f"{count} {meta['dtype']} tokens: the folder changed after "
                            f"`jaxmp data prepare`")
    return meta
