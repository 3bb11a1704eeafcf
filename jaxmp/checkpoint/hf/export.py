"""A jaxmp GPT checkpoint → a Hugging Face Llama / Mistral / Qwen2 folder.

``model.safetensors`` (or ``model-0000k-of-0000n.safetensors`` files of at most
``max_shard_bytes`` each plus ``model.safetensors.index.json``), ``config.json``, and the run's
tokenizer and the imported model's side files. Each stored array is read once and written as
its per-layer HF tensors, one array in memory at a time; tensors keep the dtype they were
imported with (as stored, for a model trained in jaxmp) unless ``dtype`` says otherwise, so
an import followed by an export gives the same bytes back.

The GPT is a Llama when it uses SwiGLU (the other choices — tied or untied head, grouped-query
attention, head_dim, rope theta and llama3 scaling, q/k/v biases for Qwen2 — all have HF
counterparts; see :mod:`jaxmp.checkpoint.hf.arch`).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import shutil
import tomllib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from jaxmp._util.io import atomic_write
from jaxmp.checkpoint import records as records_mod
from jaxmp.checkpoint import store
from jaxmp.checkpoint.hf.arch import choose_architecture, hf_config, layouts_for
from jaxmp.checkpoint.hf.files import INDEX, SINGLE
from jaxmp.checkpoint.hf.load import DTYPES_FILE, HF_DIR, SIDE_FILES, TOKENIZER
from jaxmp.checkpoint.inspect import write_safetensors
from jaxmp.errors import CheckpointError

DTYPES = ("auto", "bfloat16", "float16", "float32")
_FLOATS = DTYPES[1:]
_OLD_WEIGHTS = re.compile(r"^model(-\d+-of-\d+)?\.safetensors$")


def _run_config(step_dir: Path) -> dict[str, Any]:
    """The config saved with the checkpoint (empty for checkpoints saved without one)."""
    run = store.read_json(step_dir, "run", missing_ok=True) or {}
    return tomllib.loads(run["config_toml"]) if run.get("config_toml") else {}


def _check_gpt(records: Mapping[str, Any], model: Mapping[str, Any], step_dir: Path) -> None:
    """CheckpointError naming what keeps the GPT from being a Llama-family model."""
    activation = model.get("activation", "swiglu" if "blocks/mlp/gate" in records else "gelu")
    if activation != "swiglu":
        raise CheckpointError(f"cannot export as Llama: model.activation is "
                              f"{json.dumps(activation)} but Llama needs \"swiglu\" (train with "
                              f"--set model.activation=swiglu)")
    for path in ("embed", "blocks/attn/q", "blocks/attn/k", "blocks/mlp/up", "blocks/mlp/gate"):
        if path not in records:
            raise CheckpointError(f"checkpoint {step_dir} is not a jaxmp GPT: it has no "
                                  f"params/{path}")


def _shards(sizes: list[int], limit: int) -> list[int]:
    """Tensors per file: greedy in order, a new file when the next tensor would pass
    ``limit`` (a tensor larger than it gets a file of its own)."""
    counts, used = [], limit + 1
    for size in sizes:
        if used + size > limit and (not counts or used > 0):
            counts.append(0)
            used = 0
        counts[-1] += 1
        used += size
    return counts


def export_hf(path: str | os.PathLike, out: str | os.PathLike, step: int | None = None, *,
              architecture: str = "auto", dtype: str = "auto",
              max_shard_bytes: int = 5 * 10**9) -> dict[str, Any]:
    """Write the HF folder ``out`` from a run's checkpoint (see the module docstring).

    ``architecture``: ``auto`` (the imported model's, else Qwen2 with q/k/v biases and Llama
    without) or an HF class name. ``dtype``: ``auto`` (each tensor in the dtype it was
    imported with; a model not imported: as stored) or a float dtype name.
    The files go into a folder beside ``out`` and are moved in at the end, replacing any
    earlier weight files there, so ``out`` never mixes two exports.
    """
    if dtype not in DTYPES:
        raise CheckpointError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    if max_shard_bytes < 1:
        raise CheckpointError(f"--max-shard-size must be positive, got {max_shard_bytes}")
    ckdir, step = store.locate(path, step)
    step_dir = ckdir / str(step)
    stored = store.read_meta(step_dir)["arrays"]
    prefix = "params/" if any(p.startswith("params/") for p in stored) else ""
    padded = {p[len(prefix):]: r for p, r in stored.items() if p.startswith(prefix)}
    records = {p: records_mod.plain_record(r) for p, r in padded.items()}  # stage stacks: plain
    config = _run_config(step_dir)
    model = config.get("model", {})
    _check_gpt(records, model, step_dir)
    run_dir = ckdir.parent if ckdir.name == "checkpoints" else ckdir
    base = _json(run_dir / HF_DIR / "config.json")
    arch = choose_architecture(architecture, base, "blocks/attn/q_bias" in records)
    layouts = layouts_for(list(records))
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"--out {out}: exists and is not a folder")
    imported = _json(run_dir / HF_DIR / DTYPES_FILE) or {}

    def out_dtype(path: str, name: str) -> str:
        if dtype != "auto":
            return dtype
        return imported.get(name) if imported.get(name) in _FLOATS else records[path]["dtype"]

    tensors = []
    for lay in layouts:
        shape = records[lay.path]["shape"]
        hf_shape = lay.hf_shape(shape[1:] if lay.stacked else shape)
        for i in range(shape[0]) if lay.stacked else [None]:
            tensors.append((lay.hf_name(i), out_dtype(lay.path, lay.hf_name(i)), hf_shape))

    def arrays() -> Iterator[np.ndarray]:
        dtypes = iter(t[1] for t in tensors)
        for lay in layouts:
            a = records_mod.plain_numpy(
                store.read_numpy(step_dir, prefix + lay.path, padded[lay.path]), padded[lay.path])
            for k in range(len(a)) if lay.stacked else [None]:
                yield np.ascontiguousarray(lay.to_hf(a if k is None else a[k]),
                                           dtype=next(dtypes))
            del a  # no view of it left: freed before the next array is read

    sizes = [math.prod(s) * np.dtype(d).itemsize for _, d, s in tensors]
    counts = _shards(sizes, max_shard_bytes)
    names = [SINGLE] if len(counts) == 1 else \
        [f"model-{k + 1:05d}-of-{len(counts):05d}.safetensors" for k in range(len(counts))]
    out_type = sorted({d for _, d, _ in tensors}, key=lambda d: -np.dtype(d).itemsize)[0]
    hf = hf_config(arch, model, {p: r["shape"] for p, r in records.items()}, out_type, base,
                   int(config.get("data", {}).get("seq_len", 2048)))

    tmp = out.parent / f".{out.name}.exporting"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        stream, first, weight_map = arrays(), 0, {}
        for name, count in zip(names, counts):
            part = tensors[first:first + count]
            write_safetensors(tmp / name, part, itertools.islice(stream, count),
                              {"format": "pt", "jaxmp_step": str(step)})
            weight_map |= {t[0]: name for t in part}
            first += count
        if len(names) > 1:
            atomic_write(tmp / INDEX, json.dumps({"metadata": {"total_size": sum(sizes)},
                                                  "weight_map": weight_map}, indent=2) + "\n")
        atomic_write(tmp / "config.json", json.dumps(hf, indent=2) + "\n")
        for src in [run_dir / TOKENIZER] + [run_dir / HF_DIR / n for n in SIDE_FILES[1:]]:
            if src.is_file():
                shutil.copyfile(src, tmp / src.name)
        _move_files(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"step": step, "out": str(out), "tensors": len(tensors), "bytes": sum(sizes),
            "files": len(names), "architecture": arch}


def _json(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _move_files(tmp: Path, out: Path) -> None:
    """Move the export into ``out``, first removing the weights of an earlier export there."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.iterdir():
        if old.is_file() and (_OLD_WEIGHTS.match(old.name) or old.name == INDEX):
            old.unlink()
    for entry in tmp.iterdir():
        os.replace(entry, out / entry.name)
