"""The public checkpoint functions: restore on any mesh, save any state, describe a checkpoint.

See :mod:`jaxmp.checkpoint` for the on-disk layout. Everything here works without the model code
or the trainer.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import jax

from jaxmp import sharding
from jaxmp._util.log import say
from jaxmp.checkpoint import records as tree
from jaxmp.checkpoint import store
from jaxmp.checkpoint.store import StepInfo
from jaxmp.errors import CheckpointError
from jaxmp.mesh import make_mesh


def restore(path: str | os.PathLike, step: int | None = None, mesh: jax.sharding.Mesh | None = None,
            rules: Sequence | None = None, what: str = "params") -> dict[str, Any]:
    """Arrays of a checkpoint as nested dicts of ``jax.Array`` sharded on ``mesh``.

    ``path``: a run directory, its ``checkpoints/`` folder or one step's directory.
    ``step``: None for the latest complete step (a damaged latest falls back to the one before,
    with a warning). ``mesh``: default ``make_mesh({"fsdp": -1})`` over all devices.
    ``rules``: the ordered (logical, mesh axes) rules that place each array by its stored logical
    names (default ``rules.DEFAULT_RULES``; they replace the defaults — append
    ``rules.DEFAULT_RULES`` to extend them). ``what``: ``"params"`` (a checkpoint without a
    ``params`` subtree, e.g. a bare params tree, is all params), ``"state"`` (everything: step,
    params, opt_state, rest) or any other top-level key. Layer stacks a pipelined run stored
    padded over its stages come back in the plain ``[layers, ...]`` layout.
    """
    mesh = mesh if mesh is not None else make_mesh({"fsdp": -1})
    rules = sharding.DEFAULT_RULES if rules is None else rules

    def load(step_dir: Path) -> dict[str, Any]:
        meta = store.read_meta(step_dir)
        records = _select(meta["arrays"], what, step_dir)
        target = tree.target(records, tree.shardings_on(records, mesh, rules))
        flat = tree.flat_paths(store.restore_arrays(step_dir, target, records))
        for p, rec in records.items():  # layer stacks stored padded over pipeline stages
            if rec.get("rows") is not None:
                plain = tree.plain_record(rec)
                flat[p] = tree.convert(flat[p], rec, plain,
                                       tree.shardings_on({p: plain}, mesh, rules)[p])
        return tree.nest(tree.rewrap(flat, records))

    if step is None and not store.is_step_dir(path):
        ckdir, _ = store.locate(path)
        found = store.latest_readable(ckdir, load, say)
        if found is None:
            raise CheckpointError(f"no readable checkpoint in {ckdir}")
        out = found[1]
    else:
        ckdir, step = store.locate(path, step)
        out = load(ckdir / str(step))
    return out[what] if what != "state" and what in out else out


def _select(records: Mapping[str, Any], what: str, step_dir: Path) -> dict[str, Any]:
    tops = sorted({p.split(tree.SEP, 1)[0] for p in records})
    if what == "state" or (what == "params" and "params" not in tops):
        return dict(records)
    chosen = {p: r for p, r in records.items() if p.split(tree.SEP, 1)[0] == what}
    if not chosen:
        raise CheckpointError(f"checkpoint {step_dir} has no '{what}' arrays; what= may be "
                              f"'state' or one of: {', '.join(tops)}")
    return chosen


def save(directory: str | os.PathLike, step: int, state: Any, *,
         path_rules: Sequence | None = None, names: Mapping[str, Any] | None = None,
         config_toml: str | None = None, data_state: Mapping[str, Any] | None = None,
         keep: int | None = None, checksums: Mapping[str, str] | None = None) -> Path:
    """Save any state pytree (NNX module or state, TrainState, nested dicts) synchronously.

    Call on every process. Logical names come from NNX metadata, then ``path_rules``, then
    ``names`` (``{path: names}``, e.g. :func:`logical_names` of the checkpoint a plain tree was
    restored from); arrays without names restore replicated. ``checksums``: ``{path: record}``
    already computed (e.g. on the host while the arrays were built); by default one program
    computes them on the devices. Returns the step's directory.
    """
    ckdir = Path(directory)
    items = tree.entries(state, path_rules, names)
    meta = store.make_meta(step, items, None if checksums is None
                           else [checksums[e.path] for e in items])
    run = {"config_toml": config_toml, "plan": None} if config_toml is not None else None
    manager = store.open_manager(ckdir, keep=keep or 2**31 - 1, async_save=False)
    try:
        manager.save(step, force=True, args=store.save_args(tree.to_pure(items), meta, run,
                                                            data_state))
        manager.wait_until_finished()
    finally:
        manager.close()
    return ckdir / str(step)


def info(path: str | os.PathLike, step: int | None = None) -> dict[str, Any]:
    """What a checkpoint says about itself: ``{"step", "path", "meta", "run", "data"}``.

    ``meta["arrays"]`` maps each array path to shape, dtype, logical names and saved spec;
    ``run["config_toml"]`` is the effective config; ``data`` the data iterator's state.
    """
    ckdir, step = store.locate(path, step)
    step_dir = ckdir / str(step)
    return {"step": step, "path": str(step_dir), "meta": store.read_meta(step_dir),
            "run": store.read_json(step_dir, "run", missing_ok=True),
            "data": store.read_json(step_dir, "data", missing_ok=True)}


def logical_names(path: str | os.PathLike, step: int | None = None,
                  what: str = "state") -> dict[str, list | None]:
    """``{path: logical names}`` stored in a checkpoint, relative to ``what`` like ``restore``."""
    ckdir, step = store.locate(path, step)
    records = _select(store.read_meta(ckdir / str(step))["arrays"], what, ckdir / str(step))
    prefix = f"{what}{tree.SEP}" if what != "state" and any(
        p.startswith(f"{what}{tree.SEP}") for p in records) else ""
    return {p[len(prefix):]: tree.plain_record(r).get("names") for p, r in records.items()}


def list_steps(path: str | os.PathLike) -> list[StepInfo]:
    """Every step of a run's checkpoints, complete or not, oldest first."""
    return store.scan(store.checkpoints_dir(path))
