"""Looking into checkpoints: list, inspect (with sha256 digests) and safetensors export.

Arrays are read one at a time into host memory, so a model larger than host RAM can still be
digested or exported as long as its largest single array fits. Digests hash an array's full
value as little-endian bytes in C order, so two checkpoints of the same values — saved on any
mesh, device count or process count — have the same digests.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

import jax
from jax.experimental import multihost_utils
import numpy as np

from jaxmp._util.fmt import fmt_bytes, mesh_str, table
from jaxmp._util.io import atomic_write
from jaxmp.checkpoint import records as tree
from jaxmp.checkpoint import store
from jaxmp.errors import CheckpointError

# numpy dtype name → safetensors dtype tag
_SAFETENSORS_DTYPES = {
    "bool": "BOOL", "uint8": "U8", "int8": "I8", "uint16": "U16", "int16": "I16",
    "uint32": "U32", "int32": "I32", "uint64": "U64", "int64": "I64", "float16": "F16",
    "bfloat16": "BF16", "float32": "F32", "float64": "F64", "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2"}


def _le_bytes(a: np.ndarray) -> np.ndarray:
    """The array's values as little-endian bytes in C order (a uint8 view when possible)."""
    a = np.ascontiguousarray(a)
    if a.dtype.byteorder == ">" or (a.dtype.byteorder == "=" and not np.little_endian):
        a = a.astype(a.dtype.newbyteorder("<"))
    return a.reshape(-1).view(np.uint8)


def sha256_array(a: np.ndarray) -> str:
    """sha256 of the array's values as little-endian bytes in C order."""
    return hashlib.sha256(_le_bytes(a)).hexdigest()


def _host_value(x: Any) -> np.ndarray:
    """The full value of one (possibly multi-process) array on this host."""
    x = tree.stored_value(x)
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        if x.sharding.is_fully_replicated:
            return np.asarray(x.addressable_data(0))
        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(x)


def digest(state: Any, path_rules: Any = None) -> dict[str, str]:
    """``{path: sha256}`` of an in-memory state (e.g. what ``restore`` returned).

    Equal to ``jaxmp ckpt inspect --digest`` of a checkpoint holding the same values (for a
    ``restore(what="params")`` result, prefix the paths with ``params/``). On several processes
    every process must call it (arrays are gathered one at a time).
    """
    return {e.path: sha256_array(_host_value(e.value))
            for e in tree.entries(state, path_rules)}


def list_report(path: str | os.PathLike) -> dict[str, Any]:
    ckdir = store.checkpoints_dir(path)
    return {"dir": str(ckdir), "steps": [
        {"step": s.step, "status": s.status, "complete": s.complete, "time": s.time,
         "bytes": s.bytes, "path": s.path.name} for s in store.scan(ckdir)]}


def list_table(report: Mapping[str, Any]) -> str:
    rows = [("step", "status", "saved at", "size", "directory")]
    for s in report["steps"]:
        when = datetime.datetime.fromtimestamp(s["time"]).strftime("%Y-%m-%d %H:%M:%S") \
            if s["time"] else "-"
        rows.append((str(s["step"]), s["status"], when, fmt_bytes(s["bytes"]), s["path"]))
    if len(rows) == 1:
        return f"no checkpoints in {report['dir']}"
    return f"{report['dir']}\n" + "\n".join(table(rows[0], rows[1:], indent=""))


def inspect_report(path: str | os.PathLike, step: int | None = None,
                   with_digest: bool = False) -> dict[str, Any]:
    """``{"step", "path", "mesh", "devices", "processes", "arrays": {path: {...}}, "bytes"}``."""
    ckdir, step = store.locate(path, step)
    step_dir = ckdir / str(step)
    meta = store.read_meta(step_dir)
    arrays = {}
    for p, rec in meta["arrays"].items():
        arrays[p] = {k: rec.get(k) for k in ("shape", "dtype", "names", "spec", "bytes")}
        if rec.get("prng_impl"):
            arrays[p]["prng_impl"] = rec["prng_impl"]
        if with_digest:
            arrays[p]["sha256"] = sha256_array(store.read_numpy(step_dir, p, rec))
    return {"step": step, "path": str(step_dir), "mesh": meta.get("mesh"),
            "devices": meta.get("devices"), "processes": meta.get("processes"),
            "arrays": arrays, "bytes": sum(a["bytes"] for a in arrays.values())}


def inspect_table(report: Mapping[str, Any]) -> str:
    head = (f"checkpoint step {report['step']} ({report['path']}): {len(report['arrays'])} "
            f"arrays, {fmt_bytes(report['bytes'])}; saved on {report.get('devices')} device(s), "
            f"{report.get('processes')} process(es), mesh {mesh_str(report.get('mesh') or {})}")
    digest_col = any("sha256" in a for a in report["arrays"].values())
    rows = [("array", "shape", "dtype", "logical axes", "saved spec", "bytes")
            + (("sha256",) if digest_col else ())]
    for p, a in report["arrays"].items():
        names = "(" + ", ".join(str(n) for n in a["names"]) + ")" if a["names"] else "-"
        spec = "P(" + ", ".join(repr(tuple(e)) if isinstance(e, list) else repr(e)
                                for e in a["spec"]) + ")" if a["spec"] is not None else "-"
        rows.append((p, "x".join(map(str, a["shape"])) or "scalar", a["dtype"], names, spec,
                     fmt_bytes(a["bytes"])) + ((a.get("sha256", "")[:16],) if digest_col else ()))
    return head + "\n" + "\n".join(table(rows[0], rows[1:], indent=""))


def write_safetensors(out: str | os.PathLike,
                      tensors: Sequence[tuple[str, str, Sequence[int]]],
                      arrays: Iterable[np.ndarray], metadata: Mapping[str, str]) -> int:
    """Stream ``arrays`` into a ``.safetensors`` file (atomically); returns the data bytes.

    ``tensors``: ``(name, numpy dtype name, shape)`` of each array, in the order ``arrays``
    yields them (an iterator, so only one array need be in memory at a time).
    """
    header: dict[str, Any] = {}
    offset = 0
    for name, dtype, shape in tensors:
        if dtype not in _SAFETENSORS_DTYPES:
            raise CheckpointError(f"{name}: dtype {dtype} has no safetensors equivalent")
        size = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = dict(metadata)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned

    def chunks() -> Iterator[bytes]:
        yield len(blob).to_bytes(8, "little") + blob
        for (name, dtype, shape), a in zip(tensors, arrays, strict=True):
            if a.dtype != np.dtype(dtype) or list(a.shape) != list(shape):
                raise RuntimeError(f"{name}: got {a.dtype}{list(a.shape)}, "
                                   f"announced {dtype}{list(shape)}")
            yield _le_bytes(a).tobytes()

    atomic_write(out, chunks())
    return offset


def export_safetensors(path: str | os.PathLike, out: str | os.PathLike, step: int | None = None,
                       what: str = "params") -> dict[str, Any]:
    """Write one single-host ``.safetensors`` file, streaming one array at a time.

    ``what="params"``: the ``params`` subtree, names relative to it (``blocks/attn/q``);
    ``"state"``: every array under its full path. Logical names go into the file's metadata.
    Layer stacks a pipelined run stored padded over its stages are written in the plain
    ``[layers, ...]`` layout, as :func:`jaxmp.checkpoint.restore` returns them.
    """
    ckdir, step = store.locate(path, step)
    step_dir = ckdir / str(step)
    records = store.read_meta(step_dir)["arrays"]
    prefix = ""
    if what == "params" and any(p.startswith("params/") for p in records):
        prefix = "params/"
    elif what not in ("params", "state"):
        raise CheckpointError(f"export what= must be 'params' or 'state', got {what!r}")
    chosen = {p: r for p, r in records.items() if p.startswith(prefix)}
    plain = {p: tree.plain_record(r) for p, r in chosen.items()}
    metadata = {"format": "pt", "jaxmp_step": str(step), "logical_names": json.dumps(
        {p[len(prefix):]: r.get("names") for p, r in plain.items()})}
    size = write_safetensors(
        out, [(p[len(prefix):], r["dtype"], r["shape"]) for p, r in plain.items()],
        (tree.plain_numpy(store.read_numpy(step_dir, p, r), r) for p, r in chosen.items()),
        metadata)
    return {"step": step, "out": str(out), "arrays": len(chosen), "bytes": size}
