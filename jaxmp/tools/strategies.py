"""Strategy names for ``jaxmp bench``: mesh recipes, the planner's choices, explicit meshes.

* ``dp`` (or ``data``), ``fsdp``, ``tensor``: every device on that one axis;
* two of them joined by ``+`` (``fsdp+tensor``, ``dp+fsdp``): the inner axis (in the mesh's
  order data, stage, fsdp, tensor) gets the smallest factor that is at least √N, the outer one
  the rest (8 devices: fsdp=2 × tensor=4);
* ``stage``: the planner's best pipeline layout (the best plan among those with
  ``mesh.stage`` fixed to each stage count > 1; its split and the other axes planned);
* ``auto``: the planner's choice, as ``jaxmp train`` would run it;
* explicit sizes, ``data=2,fsdp=4`` (``-1`` fills the rest); in a list, a repeated axis starts
  the next strategy: ``dp,data=2,fsdp=4,data=4,fsdp=2`` is three.

Stdlib only: the CLI checks the names before jax starts.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxmp.config.sections import MESH_AXES
from jaxmp.errors import UsageError

DEFAULT = "dp,fsdp,tensor,fsdp+tensor,stage,auto"
_AXIS_OF = {"dp": "data", "data": "data", "fsdp": "fsdp", "tensor": "tensor"}
PLANNED = ("stage", "auto")


@dataclass(frozen=True)
class StrategySpec:
    """One requested strategy: a recipe over ``axes``, explicit ``sizes``, or ``planned``."""

    name: str
    axes: tuple[str, ...] = ()
    sizes: tuple[tuple[str, int], ...] = ()
    planned: str = ""  # "stage" | "auto": the planner chooses

    def mesh(self, n_devices: int) -> dict[str, int]:
        """The requested axis sizes on ``n_devices`` (explicit ones may hold a -1).

        Raises ValueError saying why a recipe cannot be laid out on this many devices.
        """
        if self.sizes:
            return dict(self.sizes)
        if len(self.axes) == 1:
            return {self.axes[0]: n_devices}
        outer, inner = sorted(self.axes, key=MESH_AXES.index)
        t = next(d for d in range(1, n_devices + 1) if n_devices % d == 0 and d * d >= n_devices)
        if t == 1 or t == n_devices:
            raise ValueError(f"{self.name} needs two mesh axes larger than 1, and "
                             f"{n_devices} device(s) cannot be split so")
        return {outer: n_devices // t, inner: t}


def _explicit(token: str) -> tuple[str, int]:
    axis, _, value = token.partition("=")
    axis = axis.strip()
    if axis not in MESH_AXES:
        raise UsageError(f"--strategies: unknown mesh axis {axis!r} in {token!r} "
                         f"(axes: {', '.join(MESH_AXES)})")
    try:
        size = int(value)
    except ValueError:
        raise UsageError(f"--strategies: {token!r}: the size must be an integer") from None
    if size < 1 and size != -1:
        raise UsageError(f"--strategies: {token!r}: the size must be >= 1 or -1")
    return axis, size


def _recipe(token: str) -> StrategySpec:
    if token in PLANNED:
        return StrategySpec(token, planned=token)
    parts = token.split("+")
    axes = tuple(_AXIS_OF.get(p.strip(), "") for p in parts)
    if "" in axes or len(axes) > 2 or len(set(axes)) != len(axes):
        raise UsageError(f"--strategies: unknown strategy {token!r} (dp, fsdp, tensor, "
                         f"two joined by '+', stage, auto, or explicit sizes like data=2,fsdp=4)")
    return StrategySpec(token, axes=axes)


def parse_strategies(text: str) -> list[StrategySpec]:
    """``"dp,fsdp,data=2,fsdp=4"`` → specs; bad names raise :class:`UsageError`."""
    specs: list[StrategySpec] = []
    group: list[tuple[str, int]] = []

    def close() -> None:
        if group:
            name = ",".join(f"{a}={s}" for a, s in group)
            specs.append(StrategySpec(name, sizes=tuple(group)))
            group.clear()

    for token in (t.strip() for t in text.split(",")):
        if not token:
            continue
        if "=" in token:
            axis, size = _explicit(token)
            if axis in dict(group):
                close()
            group.append((axis, size))
            continue
        close()
        specs.append(_recipe(token))
    close()
    if not specs:
        raise UsageError("--strategies: no strategy given")
    return specs


def full_mesh(sizes: dict[str, int], missing: int | str = 1) -> dict[str, int | str]:
    """All four axes, in mesh order (missing ones ``missing``: 1, or "auto" for the planner)."""
    return {a: int(sizes[a]) if a in sizes else missing for a in MESH_AXES}
