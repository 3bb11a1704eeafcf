"""Checkpoint directories on disk: which steps are complete, and one step read or written.

Atomicity is Orbax's: a step is written into ``<step>.orbax-checkpoint-tmp-<n>/``, Orbax writes
``commit_success.txt`` into it last and then renames it to ``<step>/``. So a step counts as
*complete* only when its name is a bare integer **and** the commit marker and the ``state`` and
``meta`` items are there; anything else (a leftover tmp dir, a directory copied without its
marker) is listed as incomplete and never restored. Damaged or incomplete steps that would block
a resumed run from saving that step again are renamed aside (``<step>.damaged``), never deleted.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence, TypeVar

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxmp.checkpoint import checksum
from jaxmp.checkpoint.orphans import TMP_MARK, quiet_failed_save_leftovers
from jaxmp.checkpoint import records as tree
from jaxmp.checkpoint.records import nest
from jaxmp.errors import CheckpointError, DamagedCheckpoint

FORMAT = "jaxmp.checkpoint/1"
COMMIT_FILE = "commit_success.txt"  # Orbax's marker, written just before the final rename
REQUIRED_ITEMS = ("state", "meta")
# Orbax compresses array chunks with zstd by default. Float weights barely compress (~8%: only
# the exponent bits) while zstd halved save and restore throughput on the CI box
# (scripts/measure.py checkpoint, docs/benchmarks.md), so jaxmp writes them raw; reads take both.
COMPRESS = False
_ASIDE = re.compile(r"^(\d+)\.(damaged|incomplete)(-\d+)?$")
_TMP = re.compile(r"^(\d+)" + re.escape(TMP_MARK))
_PATH = re.compile(r"[A-Za-z0-9_.\-]+(/[A-Za-z0-9_.\-]+)*")
_NAME = re.compile(r"[A-Za-z0-9_]+")
_HEX16 = re.compile(r"[0-9a-f]{16}")
# The dtypes a checkpoint may hold: numbers and booleans only (never "object").
DTYPES = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
          "float16", "bfloat16", "float32", "float64", "float8_e4m3fn", "float8_e5m2")
T = TypeVar("T")


@dataclass(frozen=True)
class StepInfo:
    """One entry of a checkpoints folder, as ``jaxmp ckpt list`` shows it."""

    step: int
    path: Path
    status: str  # "complete", "incomplete" (interrupted save) or "damaged" (set aside)
    time: float | None  # seconds since the epoch of the commit, if known
    bytes: int

    @property
    def complete(self) -> bool:
        return self.status == "complete"


def checkpoints_dir(path: str | os.PathLike) -> Path:
    """A run directory's ``checkpoints/`` folder, or ``path`` itself if it is that folder."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"checkpoint directory not found: {p}")
    if not p.is_dir():
        raise CheckpointError(f"not a directory: {p} (expected a run directory or its "
                              f"checkpoints/ folder)")
    return p / "checkpoints" if (p / "checkpoints").is_dir() else p


def is_complete(step_dir: Path) -> bool:
    return (step_dir.name.isdigit() and (step_dir / COMMIT_FILE).is_file()
            and all((step_dir / item).is_dir() for item in REQUIRED_ITEMS))


def _dir_bytes(path: Path) -> int:
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(folder, name))
            except OSError:  # removed while we walk (a concurrent cleanup)
                pass
    return total


def _commit_time(step_dir: Path) -> float | None:
    try:  # Orbax's per-step metadata (JSON): commit time in ns
        md = json.loads((step_dir / "_CHECKPOINT_METADATA").read_text())
        ns = md.get("commit_timestamp_nsecs") or md.get("init_timestamp_nsecs")
        return ns / 1e9 if ns else None
    except (OSError, ValueError, AttributeError):
        return None


def scan(ckdir: Path, sizes: bool = True) -> list[StepInfo]:
    """Every step-like entry of ``ckdir``, sorted by step (complete or not)."""
    found = []
    for child in ckdir.iterdir() if ckdir.is_dir() else ():
        if not child.is_dir():
            continue
        name = child.name
        tmp, aside = _TMP.match(name), _ASIDE.match(name)
        if name.isdigit():
            step, status = int(name), "complete" if is_complete(child) else "incomplete"
        elif tmp:
            step, status = int(tmp.group(1)), "incomplete"
        elif aside:
            step, status = int(aside.group(1)), aside.group(2)
        else:
            continue
        when = _commit_time(child) if status == "complete" else None
        if when is None:
            when = child.stat().st_mtime
        found.append(StepInfo(step, child, status, when, _dir_bytes(child) if sizes else 0))
    return sorted(found, key=lambda s: (s.step, s.status != "complete", s.path.name))


def complete_steps(ckdir: Path) -> list[int]:
    return [s.step for s in scan(ckdir, sizes=False) if s.complete]


def latest_readable(ckdir: Path, load: Callable[[Path], T], say: Callable[[str], None],
                    on_damaged: Callable[[Path], None] | None = None) -> tuple[int, T] | None:
    """``(step, load(step_dir))`` for the newest complete step that reads, or None if none.

    A step that looks complete but fails to read is reported through ``say`` and the one
    before it is tried: a damaged latest checkpoint costs progress, never the run.
    """
    steps = complete_steps(ckdir)
    for i in range(len(steps) - 1, -1, -1):
        step_dir = ckdir / str(steps[i])
        try:
            return steps[i], load(step_dir)
        except DamagedCheckpoint as e:
            then = (f"falling back to step {steps[i - 1]}" if i else
                    "no older complete checkpoint is left")
            say(f"jaxmp: warning: {e}; {then}")
            if on_damaged is not None:
                on_damaged(step_dir)
    return None


def is_step_dir(path: str | os.PathLike) -> bool:
    p = Path(path)
    return p.is_dir() and p.name.isdigit() and (p / "meta").is_dir()


def locate(path: str | os.PathLike, step: int | None = None) -> tuple[Path, int]:
    """``(checkpoints folder, step)`` for a run dir, checkpoints folder or step directory.

    ``step=None`` means the latest complete step. Errors name the folder and the steps there.
    """
    p = Path(path)
    if is_step_dir(p):
        if step is not None and step != int(p.name):
            raise CheckpointError(f"{p} is the checkpoint of step {p.name}, not step {step}")
        step, p = int(p.name), p.parent
    ckdir = checkpoints_dir(p)
    infos = scan(ckdir, sizes=False)
    steps = [s.step for s in infos if s.complete]
    if step is None:
        if not steps:
            raise CheckpointError(f"no complete checkpoint in {ckdir}")
        return ckdir, steps[-1]
    if step not in steps:
        other = [s for s in infos if s.step == step]
        if other:
            raise CheckpointError(f"checkpoint step {step} in {ckdir} is {other[0].status} "
                                  f"({other[0].path.name}); complete steps: {_show(steps)}")
        raise CheckpointError(f"no checkpoint for step {step} in {ckdir}; complete steps: "
                              f"{_show(steps)}")
    return ckdir, step


def _show(steps: list[int]) -> str:
    if not steps:
        return "none"
    return ", ".join(map(str, steps)) if len(steps) <= 8 else \
        f"{', '.join(map(str, steps[:3]))}, ..., {', '.join(map(str, steps[-3:]))}"


def set_aside(step_dir: Path, why: str) -> Path:
    """Rename a bad step out of Orbax's way (``<step>.<why>``), keeping its files."""
    base = step_dir.name.split(".", 1)[0]
    new, n = step_dir.with_name(f"{base}.{why}"), 0
    while new.exists():
        n += 1
        new = step_dir.with_name(f"{base}.{why}-{n}")
    os.replace(step_dir, new)
    return new


# ------------------------------------------------------------------------------- reading


def read_json(step_dir: Path, item: str, missing_ok: bool = False) -> Any:
    """One JSON item of a step (``meta``, ``run``, ``data``)."""
    if not (step_dir / item).is_dir():
        if missing_ok:
            return None
        raise DamagedCheckpoint(f"checkpoint {step_dir} has no '{item}' item")
    try:
        return ocp.Checkpointer(ocp.JsonCheckpointHandler()).restore((step_dir / item).absolute())
    except Exception as e:  # noqa: BLE001 - Orbax/tensorstore raise many types for bad files
        raise DamagedCheckpoint(f"checkpoint {step_dir}: cannot read '{item}': {_one_line(e)}") \
            from None


def read_meta(step_dir: Path) -> dict[str, Any]:
    """The step's ``meta`` item, checked field by field (it is data, never code: a value of
    an unexpected type or an unknown dtype makes the step damaged, nothing else)."""
    meta = read_json(step_dir, "meta")
    fmt = meta.get("format") if isinstance(meta, dict) else None
    if fmt != FORMAT or "arrays" not in meta:
        raise CheckpointError(f"checkpoint {step_dir} was not written by jaxmp "
                              f"(meta format {fmt!r}, expected {FORMAT!r})")
    problem = _meta_problem(meta)
    if problem:
        raise DamagedCheckpoint(f"checkpoint {step_dir} has an invalid meta item: {problem}")
    return meta


def _meta_problem(meta: Mapping[str, Any]) -> str | None:
    """The first field of ``meta`` with an unexpected type or value, as a phrase, or None."""
    def is_int(x: Any) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    if not is_int(meta.get("step")):
        return f"step is {_brief(meta.get('step'))}, expected an integer"
    arrays = meta["arrays"]
    if not isinstance(arrays, dict) or not arrays:
        return f"arrays is {_brief(arrays)}, expected a non-empty table"
    for path, rec in arrays.items():
        where = f"arrays[{path!r}]"
        if not _PATH.fullmatch(path) or ".." in path.split("/"):
            return f"array path {path!r} is not a plain name/name/... path"
        if not isinstance(rec, dict):
            return f"{where} is {_brief(rec)}, expected a table"
        shape, dtype, names = rec.get("shape"), rec.get("dtype"), rec.get("names")
        if not isinstance(shape, list) or not all(is_int(d) and d >= 0 for d in shape):
            return f"{where}.shape is {_brief(shape)}, expected a list of sizes"
        if dtype not in DTYPES:
            return f"{where}.dtype is {_brief(dtype)}, expected one of {', '.join(DTYPES)}"
        if names is not None and not (isinstance(names, list) and len(names) <= len(shape) and
                                      all(n is None or isinstance(n, str) for n in names)):
            return f"{where}.names is {_brief(names)}, expected a list of names or null"
        spec = rec.get("spec")
        if spec is not None and not (isinstance(spec, list) and all(
                e is None or isinstance(e, str) or (isinstance(e, list) and all(
                    isinstance(a, str) for a in e)) for e in spec)):
            return f"{where}.spec is {_brief(spec)}, expected a PartitionSpec as a list"
        impl, sums = rec.get("prng_impl"), rec.get(checksum.KEY)
        if impl is not None and not (isinstance(impl, str) and _NAME.fullmatch(impl)):
            return f"{where}.prng_impl is {_brief(impl)}, expected a PRNG implementation name"
        if sums is not None and not (isinstance(sums, str) and _HEX16.fullmatch(sums)):
            return f"{where}.{checksum.KEY} is {_brief(sums)}, expected 16 hex digits"
    return None


def _brief(x: Any) -> str:
    text = repr(x)
    return text if len(text) <= 60 else text[:57] + "..."


def restore_arrays(step_dir: Path, target: Mapping[str, Any],
                   records: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Read the arrays named by ``target`` (nested ShapeDtypeStructs with shardings) and check
    each against its record's checksum (:mod:`jaxmp.checkpoint.checksum`).

    Partial restore: arrays not in the target (e.g. the optimizer state when only the params
    are wanted) are not read at all.
    """
    restore_args = ocp.checkpoint_utils.construct_restore_args(target)
    out = _restore(step_dir, target, restore_args)
    flat = tree.flat_paths(out)
    checksum.verify(str(step_dir), records, list(flat), checksum.checksums(list(flat.values())))
    return out


def read_numpy(step_dir: Path, path: str, record: Mapping[str, Any]) -> np.ndarray:
    """One whole array into host memory as numpy (for digests and export, one at a time)."""
    sds = jax.ShapeDtypeStruct(tuple(record["shape"]), np.dtype(record["dtype"]))
    out = _restore(step_dir, nest({path: sds}),
                   nest({path: ocp.RestoreArgs(restore_type=np.ndarray)}))
    for key in path.split("/"):
        out = out[key]
    out = np.asarray(out)
    checksum.verify(str(step_dir), {path: record}, [path], [checksum.checksum_numpy(out)])
    return out


def _restore(step_dir: Path, target: Any, restore_args: Any) -> dict[str, Any]:
    try:
        return ocp.PyTreeCheckpointer().restore(  # Orbax refuses relative paths
            (step_dir / "state").absolute(), args=ocp.args.PyTreeRestore(
                item=target, restore_args=restore_args, partial_restore=True))
    except Exception as e:  # noqa: BLE001
        raise DamagedCheckpoint(f"checkpoint {step_dir} is damaged or unreadable: "
                              f"{_one_line(e)}") from None


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= 300 else text[:297] + "..."


# ------------------------------------------------------------------------------- writing


def remove_partial(ckdir: Path) -> list[Path]:
    """Delete every interrupted save (Orbax tmp folder) in ``ckdir``; returns what went."""
    gone = []
    for info in scan(ckdir, sizes=False):
        if _TMP.match(info.path.name):
            shutil.rmtree(info.path, ignore_errors=True)
            gone.append(info.path)
    return gone


def write_failure(error: BaseException) -> tuple[int | None, str]:
    """(step, cause) of a failed write as Orbax / TensorStore report it: the step from the tmp
    folder's name when it appears, the cause as the OS error's text when there is one."""
    text = " ".join(str(error).split())
    step = re.search(r"/(\d+)" + re.escape(TMP_MARK), text)
    code = re.search(r"os_error_code='?(\d+)", text)
    if code:
        cause = f"{os.strerror(int(code.group(1)))} (errno {code.group(1)})"
    elif isinstance(error, OSError) and error.strerror:
        cause = error.strerror
    else:
        cause = text if len(text) <= 200 else text[:197] + "..."
    return (int(step.group(1)) if step else None), cause


def open_manager(ckdir: Path, *, keep: int, keep_period: int = 0, async_save: bool = True,
                 compress: bool = COMPRESS) -> ocp.CheckpointManager:
    """An Orbax manager that keeps the latest ``keep`` steps plus every ``keep_period``-th."""
    cm = ocp.checkpoint_managers
    policies = [cm.LatestN(keep)] + ([cm.EveryNSteps(keep_period)] if keep_period else [])
    options = ocp.CheckpointManagerOptions(
        enable_async_checkpointing=async_save, create=True, cleanup_tmp_directories=True,
        preservation_policy=cm.AnyPreservationPolicy(policies))
    registry = ocp.DefaultCheckpointHandlerRegistry()
    arrays = ocp.PyTreeCheckpointHandler(use_compression=compress)
    registry.add("state", ocp.args.PyTreeSave, arrays)
    registry.add("state", ocp.args.PyTreeRestore, arrays)
    for item in ("meta", "run", "data"):
        registry.add(item, ocp.args.JsonSave)
        registry.add(item, ocp.args.JsonRestore)
    quiet_failed_save_leftovers()  # after a failed async write: one error line, not 300
    return ocp.CheckpointManager(ckdir.absolute(), options=options, handler_registry=registry)


def save_args(pure: Mapping[str, Any], meta: Mapping[str, Any], run: Mapping[str, Any] | None,
              data: Mapping[str, Any] | None) -> ocp.args.Composite:
    """The Orbax items of one step (see :mod:`jaxmp.checkpoint`)."""
    items: dict[str, Any] = {"state": ocp.args.PyTreeSave(pure), "meta": ocp.args.JsonSave(meta)}
    if run is not None:
        items["run"] = ocp.args.JsonSave(run)
    if data is not None:
        items["data"] = ocp.args.JsonSave(data)
    return ocp.args.Composite(**items)


def make_meta(step: int, items: Sequence[tree.Entry],
              sums: Sequence[str | None] | None = None) -> dict:
    """The ``meta`` item of a step: format, mesh, and per array its record and checksum
    (``sums``, or computed here: on several processes every process must call it then)."""
    records = {e.path: tree.record(e) for e in items}
    if sums is None:
        sums = checksum.checksums([tree.stored_value(e.value) for e in items])
    for rec, value in zip(records.values(), sums):
        rec[checksum.KEY] = value
    return {"format": FORMAT, "step": int(step), "time": time.time(),
            "mesh": tree.saved_mesh([e.value for e in items]), "devices": jax.device_count(),
            "processes": jax.process_count(), "platform": jax.devices()[0].platform,
            "arrays": records}
