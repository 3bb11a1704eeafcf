"""Set-up checks a Trainer makes before it compiles anything: refuse, or warn, in one line.

The sharding rules fall back silently by design (an axis that does not divide a dimension is
skipped), which is right for one odd-sized array but wrong when it silently changes the whole
run: a batch the batch axes cannot split is computed whole on every device, and a mesh axis
that shards no parameter holds copies that all compute the same thing. These are caught here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import Mesh

from jaxmp import sharding
from jaxmp._util.fmt import mesh_str
from jaxmp.errors import ConfigError
from jaxmp.train.state import StateLayout
from jaxmp.train.step import batch_spec

PARAM_AXES = ("fsdp", "tensor")  # mesh axes whose only purpose is to split the weights


def _axes_of(spec: Any) -> list[str]:
    out: list[str] = []
    for entry in spec:
        if entry is not None:
            out.extend([entry] if isinstance(entry, str) else entry)
    return out


def batch_shards(mesh: Mesh, rules: Sequence) -> dict[str, int]:
    """The mesh axes (and sizes) the rules split the logical ``batch`` over."""
    intended = batch_spec(mesh, rules, mesh.size)  # mesh.size divides by every axis product
    return {a: int(mesh.shape[a]) for a in _axes_of(intended)}


def check_batch(mesh: Mesh, rules: Sequence, batch_size: int, grad_accum: int = 1) -> None:
    """Refuse a global batch (or microbatch) that the batch axes cannot split evenly.

    Without this the rules' divisibility fallback would replicate the batch: every device
    computing every row, silently.
    """
    axes = batch_shards(mesh, rules)
    n = math.prod(axes.values())
    where = f"the {n} batch shards of mesh {mesh_str(axes)}"
    if batch_size % n:
        raise ConfigError(f"train.batch_size: {batch_size} does not divide over {where}; "
                          f"use a multiple of {n}")
    micro = batch_size // grad_accum
    if grad_accum > 1 and micro % n:
        raise ConfigError(f"train.batch_size: {batch_size} / train.microbatches={grad_accum} = "
                          f"{micro} rows per microbatch, which do not divide over {where}; "
                          f"use a multiple of {n * grad_accum}")


def warn_idle_axes(layout: StateLayout, rules: Sequence, path_rules: Sequence | None,
                   say: Callable[[str], None]) -> list[str]:
    """Warn about each weight-splitting mesh axis (size > 1) that shards no parameter.

    Names the fallback that made the rules skip it (e.g. a dim its size does not divide).
    Returns the idle axes.
    """
    mesh = layout.mesh
    used = {a for s in jax.tree.leaves(layout.shardings.params) for a in _axes_of(s.spec)}
    idle = [a for a in PARAM_AXES if mesh.shape.get(a, 1) > 1 and a not in used]
    if not idle:
        return idle
    report = sharding.lint(layout.abstract.params, mesh, rules=rules, path_rules=path_rules)
    for axis in idle:
        skipped = [f for f in report.fallbacks if f.mesh_axis == axis]
        why = (f"e.g. {skipped[0].path} dim {skipped[0].dim} ('{skipped[0].logical}', size "
               f"{skipped[0].dim_size}) is not divisible by {axis}={mesh.shape[axis]}"
               if skipped else "no rule maps a parameter's logical name to it")
        say(f"jaxmp: warning: mesh axis {axis}={mesh.shape[axis]} shards no parameter ({why}); "
            f"the rules fell back to replicating every parameter over it")
    return idle
