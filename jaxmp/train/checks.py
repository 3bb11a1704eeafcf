"""Set-up checks a Trainer makes before it compiles anything: refuse, or warn, in one line.

The sharding rules fall back silently by design (an axis that does not divide a dimension is
skipped), which is right for one odd-sized array but wrong when it silently changes the whole
run: a batch the batch axes cannot split is computed whole on every device, and a mesh axis
that shards no parameter holds copies that all compute the same thing. These are caught here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import Mesh

from jaxmp import sharding
from jaxmp.mesh import mesh_shape
from jaxmp.plan import check_batch as plan_check_batch
from jaxmp.train.state import StateLayout

PARAM_AXES = ("fsdp", "tensor")  # mesh axes whose only purpose is to split the weights


def _axes_of(spec: Any) -> list[str]:
    out: list[str] = []
    for entry in spec:
        if entry is not None:
            out.extend([entry] if isinstance(entry, str) else entry)
    return out


def check_batch(mesh: Mesh, rules: Sequence, batch_size: int, microbatches: int = 1) -> None:
    """Refuse a global batch (or microbatch) that ``mesh``'s batch axes cannot split evenly
    (:func:`jaxmp.plan.check_batch`, which the planner asks first)."""
    plan_check_batch(mesh_shape(mesh), rules, batch_size, microbatches)


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
