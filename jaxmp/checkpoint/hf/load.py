"""A Hugging Face Llama-family folder → the GPT's params, placed straight onto a mesh.

Nothing is materialised whole. Each param's sharding comes from its logical names and the
rules (as for a restore); each local device is then sent its slice, cut from the
memory-mapped HF tensor (a view: only the pages it covers are read; a slice several devices
share is cut once) and assembled with ``jax.make_array_from_single_device_arrays`` — like
``jax.make_array_from_callback``, but with one slice on the host at a time. A layer stack
``[layers, ...]`` starts as zeros in its shards and receives one HF layer at a time through a
donated in-place update, so the host holds one HF tensor and one slice of it at most. On
several processes each sends only to its own devices, so it reads only their slices.

:func:`import_checkpoint` writes what a run directory needs (a step-0 checkpoint of the
params, ``config.toml``, the tokenizer; under ``hf/`` the source's small JSON files and each
tensor's stored dtype) into a folder beside the target and renames it into place at the end:
a failed import leaves nothing.
"""

from __future__ import annotations

import functools
import json
import math
import os
import shutil
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from jaxmp import sharding
from jaxmp._util.io import atomic_write
from jaxmp._util.log import say
from jaxmp.checkpoint import checksum, records, store
from jaxmp.checkpoint.api import save
from jaxmp.checkpoint.hf.arch import IGNORED, Layout, layouts_for, read_config
from jaxmp.checkpoint.hf.files import Tensor, Weights, mapped
from jaxmp.errors import CheckpointError, RunDirError
from jaxmp.mesh import make_mesh
from jaxmp.models import GPT, GPTConfig

SIDE_FILES = ("config.json", "generation_config.json", "tokenizer_config.json",
              "special_tokens_map.json")  # kept under RUN_DIR/hf/; export writes them back
HF_DIR = "hf"
DTYPES_FILE = "dtypes.json"  # RUN_DIR/hf/: each imported tensor's stored dtype, for export
TOKENIZER = "tokenizer.json"


@dataclass(frozen=True)
class Param:
    """One GPT param to fill: its path, jaxmp shape and dtype, sharding and HF source."""

    path: str
    shape: tuple[int, ...]
    dtype: np.dtype
    names: tuple[str | None, ...] | None
    layout: Layout
    tensors: tuple[Tensor, ...]  # one per layer for a stacked param


def gpt_params(cfg: GPTConfig) -> dict[str, dict[str, Any]]:
    """``{path: record}`` (shape, dtype, logical names) of the GPT's params, from the model."""
    model = sharding.abstract(lambda: GPT(cfg, rngs=nnx.Rngs(0)))
    return {e.path: records.record(e) for e in records.entries(nnx.state(model, nnx.Param))}


def match(weights: Weights, params: Mapping[str, Mapping[str, Any]], where: str,
          vocab: int | None = None) -> list[Param]:
    """Pair every GPT param with its HF tensor(s), checking names, shapes and dtypes first
    (before any device work); unexpected tensors are refused too — they mean the checkpoint
    computes something the GPT would not. ``vocab``: the checkpoint's vocabulary (config.json),
    which the GPT's may exceed (padding); default: the GPT's."""
    out, used = [], set()
    tied = "unembed" not in params
    for lay in layouts_for(list(params)):
        rec = params[lay.path]
        shape = tuple(rec["shape"])
        layer_shape = shape[1:] if lay.stacked else shape
        want = list(lay.hf_shape(layer_shape))
        if lay.vocab_axis is not None and vocab is not None:
            want[lay.hf_vocab_axis()] = vocab
        tensors = []
        for i in range(shape[0]) if lay.stacked else [None]:
            name = lay.hf_name(i)
            if name not in weights:
                raise CheckpointError(f"{where}: tensor {name} is missing (expected "
                                      f"{want})")
            t = weights[name]
            if list(t.shape) != want:
                raise CheckpointError(f"{where}: tensor {name} has shape {list(t.shape)}, "
                                      f"expected {want} (from config.json)")
            if t.dtype.kind != "f" and t.dtype.name != "bfloat16":
                raise CheckpointError(f"{where}: tensor {name} is {t.dtype.name}; jaxmp imports "
                                      f"float tensors (bf16, fp16, fp32), not quantized ones")
            tensors.append(t)
            used.add(name)
        out.append(Param(lay.path, shape, np.dtype(rec["dtype"]),
                         tuple(rec["names"]) if rec["names"] else None, lay, tuple(tensors)))
    extra = [n for n in weights if n not in used and not IGNORED.search(n)
             and not (tied and n == "lm_head.weight")]  # HF may store a tied head anyway
    if extra:
        raise CheckpointError(f"{where}: tensor {extra[0]} has no place in jaxmp's GPT "
                              f"({len(extra)} such tensor(s)); the model computes something "
                              f"the mapping does not")
    return out


def _cut(view: np.ndarray, bounds: Sequence[tuple[int, int]], dtype: np.dtype) -> np.ndarray:
    """A copy of the slice ``bounds`` of ``view`` in ``dtype``, zero-padded where ``view``
    ends (a vocabulary padded past the checkpoint's)."""
    if all(b <= n for (_, b), n in zip(bounds, view.shape)):
        return np.array(view[tuple(slice(a, b) for a, b in bounds)], dtype)
    out = np.zeros([b - a for a, b in bounds], dtype)
    have = [(a, min(b, n)) for (a, b), n in zip(bounds, view.shape)]
    if all(b > a for a, b in have):
        out[tuple(slice(0, b - a) for a, b in have)] = view[tuple(slice(a, b) for a, b in have)]
    return out


def _view_shape(p: Param, t: Tensor) -> tuple[int, ...]:
    """The jaxmp (per-layer) shape backed by ``t``: the param's, with HF's vocabulary size."""
    shape = list(p.shape[1:] if p.layout.stacked else p.shape)
    if p.layout.vocab_axis is not None:
        shape[p.layout.vocab_axis] = t.shape[p.layout.hf_vocab_axis()]
    return tuple(shape)


def _placed(p: Param, t: Tensor, shape: tuple[int, ...], where: NamedSharding,
            at: tuple[int, ...] = ()) -> tuple[jax.Array, tuple[int, int]]:
    """HF tensor ``t`` in the jaxmp layout of ``shape``, each local device sent its slice
    as soon as it is cut (slices that several devices share are cut once). The host holds
    the mapped tensor and one slice; the mapping ends with this function.

    Also returns this process's part of the param's checksum sums: over the slices it is
    the first holder of (``at``: the layer's index in its stack), so that the parts of all
    processes add up to each element once."""
    view = p.layout.to_jaxmp(mapped(t), _view_shape(p, t))
    local = where.addressable_devices_indices_map(shape)
    wanted: dict[tuple, list[jax.Device]] = {}
    first: dict[tuple, jax.Device] = {}
    for device, index in where.devices_indices_map(shape).items():
        bounds = tuple(s.indices(n)[:2] for s, n in zip(index, shape))
        first.setdefault(bounds, device)
        if device in local:
            wanted.setdefault(bounds, []).append(device)
    shards, total, weighted = {}, 0, 0
    full = (len(p.tensors),) + shape if at else shape
    for bounds, devices in wanted.items():
        piece = _cut(view, bounds, p.dtype)
        shards |= {d: jax.device_put(piece, d) for d in devices}
        if first[bounds] in devices:
            s1, s2 = checksum.block_sums(piece[None] if at else piece,
                                         at + tuple(a for a, _ in bounds), full)
            total, weighted = total + s1, weighted + s2
        del piece
    array = jax.make_array_from_single_device_arrays(shape, where, [shards[d] for d in local])
    return array, (total, weighted)


@functools.lru_cache(maxsize=64)
def _zeros(shape: tuple[int, ...], dtype: np.dtype, where: NamedSharding):
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=where)


@functools.lru_cache(maxsize=64)
def _set_layer(where: NamedSharding):
    """``stack.at[i].set(layer)`` in place (the stack is donated), result on ``where``."""
    return jax.jit(lambda stack, layer, i: jax.lax.dynamic_update_index_in_dim(
        stack, layer, i, 0), out_shardings=where, donate_argnums=0)


def place(params: Sequence[Param], mesh: jax.sharding.Mesh, rules: Sequence | None = None,
          ) -> Iterator[tuple[str, jax.Array, tuple[int, int]]]:
    """``(path, array, sums)`` per param, each built on ``mesh`` from its HF tensor(s), one at
    a time (drop an array once used and the host never holds more than one); ``sums``: this
    process's part of its checksum (:func:`jaxmp.checkpoint.checksum.block_sums`)."""
    rules = sharding.DEFAULT_RULES if rules is None else rules
    recs = {p.path: {"shape": list(p.shape), "names": list(p.names) if p.names else None}
            for p in params}
    placement = records.shardings_on(recs, mesh, rules)
    for p in params:  # a yielded array is referenced by nothing here once the caller drops it
        if p.layout.stacked:
            yield p.path, *_stacked(p, placement[p.path])
        else:
            yield p.path, *_placed(p, p.tensors[0], p.shape, placement[p.path])


def _stacked(p: Param, where: NamedSharding) -> tuple[jax.Array, tuple[int, int]]:
    """A layer stack filled one HF layer at a time, in place (the stack is donated)."""
    layer_where = NamedSharding(where.mesh, PartitionSpec(*where.spec[1:]))
    stack, total, weighted = _zeros(p.shape, p.dtype, where)(), 0, 0
    for i, t in enumerate(p.tensors):
        layer, (s1, s2) = _placed(p, t, p.shape[1:], layer_where, at=(i,))
        stack = _set_layer(where)(stack, layer, np.int32(i))
        total, weighted = total + s1, weighted + s2
    return stack, (total, weighted)


def _checksums(parts: dict[str, tuple[int, int]]) -> dict[str, str]:
    """Checksum records from every process's parts of the sums (one all-gather)."""
    local = np.array([[a % 2**64, b % 2**64] for a, b in parts.values()], np.uint64)
    every = multihost_utils.process_allgather(local) if jax.process_count() > 1 else local[None]
    summed = every.sum(axis=0, dtype=np.uint64)  # wraps mod 2**64, which 2**32 divides
    return {path: checksum.from_sums(int(a), int(b)) for path, (a, b) in zip(parts, summed)}


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def _target(out: Path, into_existing: bool) -> None:
    """Refuse an ``out`` that is a file, or a folder with contents when not allowed."""
    if out.exists() and not out.is_dir():
        raise RunDirError(f"--out {out}: exists and is not a folder")
    if out.is_dir() and not into_existing and any(out.iterdir()):
        raise RunDirError(f"--out {out}: exists and is not empty (import into a new folder)")
    if out.is_dir() and store.complete_steps(store.checkpoints_dir(out)):
        raise RunDirError(f"{out}: already holds checkpoints; import into a new run directory")


def import_checkpoint(hf_dir: str | os.PathLike, out: str | os.PathLike, cfg: GPTConfig,
                      config_toml: str, *, mesh: jax.sharding.Mesh | None = None,
                      rules: Sequence | None = None, into_existing: bool = False,
                      ) -> dict[str, Any]:
    """Write the run directory ``out`` from the Hugging Face folder ``hf_dir``.

    ``cfg`` must be the GPT that ``hf_dir``'s config.json describes (see
    :func:`jaxmp.checkpoint.hf.arch.model_keys`); ``config_toml`` is written as the run's
    config. ``mesh`` (default: every device on ``fsdp``) is where the params are built; the
    checkpoint restores on any other. ``into_existing``: ``out`` may be an existing folder
    without checkpoints (``jaxmp train --init-from``). Call on every process.
    """
    hf_dir, out = Path(hf_dir), Path(out)
    start = time.perf_counter()
    weights = Weights(hf_dir)
    vocab = read_config(hf_dir).get("vocab_size")
    params = match(weights, gpt_params(cfg), str(hf_dir), vocab if isinstance(vocab, int) else None)
    _target(out, into_existing)
    mesh = mesh if mesh is not None else make_mesh({"fsdp": -1})
    tmp = out.parent / f".{out.name}.importing"
    main = jax.process_index() == 0
    if main:
        if tmp.exists():  # a crashed import's leftovers
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    _barrier("jaxmp_hf_import_start")
    try:
        arrays, parts = {}, {}
        for path, array, sums in place(params, mesh, rules):
            arrays[path], parts[f"params/{path}"] = array, sums
        # checksums from the host's slices: the device program would need several times
        # the state in scratch on CPU devices
        save(tmp / "checkpoints", 0, {"params": records.nest(arrays)},
             names={f"params/{p.path}": p.names for p in params}, config_toml=config_toml,
             checksums=_checksums(parts))
        del arrays
        if main:
            _side_files(hf_dir, tmp, config_toml)
            atomic_write(tmp / HF_DIR / DTYPES_FILE, json.dumps(
                {t.name: t.dtype.name for p in params for t in p.tensors}, indent=0) + "\n")
        _barrier("jaxmp_hf_import_written")
        if main:
            _move_into_place(tmp, out)
        _barrier("jaxmp_hf_import_done")
    except BaseException:
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    stored = sum(math.prod(p.shape) * p.dtype.itemsize for p in params)
    return {"out": str(out), "tensors": sum(len(p.tensors) for p in params),
            "read_bytes": sum(t.nbytes for p in params for t in p.tensors),
            "param_bytes": stored, "seconds": time.perf_counter() - start,
            "mesh": {k: int(v) for k, v in mesh.shape.items()}}


def _side_files(hf_dir: Path, run: Path, config_toml: str) -> None:
    atomic_write(run / "config.toml", config_toml)
    if (hf_dir / TOKENIZER).is_file():
        shutil.copyfile(hf_dir / TOKENIZER, run / TOKENIZER)
    (run / HF_DIR).mkdir(exist_ok=True)
    for name in SIDE_FILES:
        if (hf_dir / name).is_file():
            shutil.copyfile(hf_dir / name, run / HF_DIR / name)


def _move_into_place(tmp: Path, out: Path) -> None:
    """``tmp`` becomes ``out`` (one rename), or its entries move into an existing ``out``
    with the checkpoints last, so an interrupted move leaves a run without a checkpoint."""
    if not out.exists():
        os.replace(tmp, out)
        return
    for entry in sorted(tmp.iterdir(), key=lambda e: e.name == "checkpoints"):
        dest = out / entry.name
        if dest.is_dir() and entry.is_dir():
            shutil.rmtree(dest)
        os.replace(entry, dest)
    tmp.rmdir()


def warn_sliding_window(window: int | None, where: str) -> None:
    if window is not None:
        say(f"jaxmp: note: {where} uses a sliding attention window of {window} tokens; jaxmp's "
            f"GPT attends to the whole context (the same for sequences up to {window})")
