"""Logical axis names → a PartitionSpec: the ordered rules and how one array is resolved.

Model code names array dimensions logically (``("embed", "mlp")``) and never mentions a mesh
axis; this module is the one place that maps one array's names onto the mesh axes ``data``,
``stage``, ``fsdp`` and ``tensor`` (see :mod:`jaxmp.mesh`). Whole trees are in
:mod:`jaxmp.sharding.tree`, activations in :mod:`jaxmp.sharding.activations`.

Resolution is an ordered rule list where the *first free match wins*, as in Linen and MaxText,
except that a logical name may appear in several rules which are tried in turn: a mesh axis
that is missing, of size 1, already used by another dimension of the same array, or that does
not divide the dimension is skipped and the next rule for that name gets its chance. (Flax
NNX's dict-based rules keep only the last rule per name, so they cannot express fallbacks.)

Two conventions follow Flax and JAX so that research code works as written: fewer names than
dims are padded with None (the trailing dims are replicated), and a name that is itself a mesh
axis of the current mesh, with no rule of its own, means that mesh axis (Flax examples often
annotate with mesh-axis names directly).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Union

from jax.sharding import PartitionSpec as P

from jaxmp.mesh import mesh_shape

Axes = Union[str, tuple[str, ...], None]
Rule = tuple[str, Axes]
Names = tuple[Union[str, None], ...]
PathRule = tuple[str, Names]

# Order matters: for each dimension the first rule whose mesh axes are still free wins.
DEFAULT_RULES: tuple[Rule, ...] = (
    # Activations. The batch is split over data *and* fsdp (ZeRO: fsdp devices hold different
    # examples and only gather parameters); the residual stream stays replicated over tensor so
    # that only the Megatron-style inner dims (mlp, heads, vocab) are split.
    ("batch", ("data", "fsdp")),
    ("seq", None),
    ("act_embed", None),
    ("act_mlp", "tensor"),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_vocab", "tensor"),
    # Parameters, primary placement: tensor parallelism on the wide inner dims, fsdp on the
    # model dim, so an ("embed", "mlp") kernel is split both ways on a 2-D mesh.
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("norm", "fsdp"),  # ZeRO-3 shards even small vectors: per-device state is exactly total / N
    ("layers", None),  # stacked-layers axis: scanned over, so every device needs every layer
    # Fallbacks, tried only when the rules above left the dim unassigned: with no tensor axis,
    # or when embed does not divide by fsdp, the big matrices still shard their other dim.
    ("mlp", "fsdp"),
    ("heads", "fsdp"),
    ("kv_heads", "fsdp"),
    ("vocab", "fsdp"),
)

@dataclass(frozen=True)
class Fallback:
    """A mesh axis skipped only because its size does not divide the dimension (for lint)."""

    path: str
    dim: int
    logical: str
    mesh_axis: str
    axis_size: int
    dim_size: int


@dataclass(frozen=True)
class Resolution:
    """The spec of one array plus what lint needs to explain it."""

    spec: P
    fired: frozenset[int]  # rule indices that assigned an axis or replicated a dim
    considered: frozenset[int]  # rule indices that saw an unassigned dim with their name
    fallbacks: tuple[Fallback, ...]


def normalize_rules(rules: Sequence[Sequence[Any]]) -> tuple[Rule, ...]:
    """Turn rules (possibly lists, e.g. from TOML) into hashable ``(name, axes)`` pairs."""
    out: list[Rule] = []
    for rule in rules:
        if len(rule) != 2 or not isinstance(rule[0], str):
            raise ValueError(f"a rule is (logical_name, mesh_axes), got {rule!r}")
        name, axes = rule
        if axes is None or isinstance(axes, str):
            out.append((name, axes))
        elif isinstance(axes, (tuple, list)) and all(isinstance(a, str) for a in axes):
            out.append((name, tuple(axes)))
        else:
            raise ValueError(
                f"rule {name!r}: mesh axes must be str, tuple of str or None, got {axes!r}")
    return tuple(out)


def normalize_spec(entries: Sequence[Any]) -> P:
    """PartitionSpec without trailing Nones, because ``P('a', None) != P('a')``."""
    entries = list(entries)
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def resolve(names: Names, shape: Sequence[int], mesh_sizes: dict[str, int],
            rules: Sequence[Rule], path: str = "") -> Resolution:
    """Apply ordered rules to one array (first free match wins; see module docstring)."""
    unset = object()
    assigned: list[Any] = [unset] * len(names)
    used: set[str] = set()
    fired: set[int] = set()
    considered: set[int] = set()
    fallbacks: list[Fallback] = []
    for idx, (logical, axes) in enumerate(rules):
        for i, name in enumerate(names):
            if name != logical or assigned[i] is not unset:
                continue
            considered.add(idx)
            if axes is None:  # explicit replication: the dim is settled, later rules don't apply
                assigned[i] = None
                fired.add(idx)
                continue
            chosen: list[str] = []
            for ax in (axes,) if isinstance(axes, str) else axes:
                size = mesh_sizes.get(ax, 1)
                if size == 1 or ax in used or ax in chosen:
                    continue
                if shape[i] % (math.prod(mesh_sizes[a] for a in chosen) * size):
                    fallbacks.append(Fallback(path, i, logical, ax, size, int(shape[i])))
                    continue
                chosen.append(ax)
            if chosen:
                assigned[i] = chosen[0] if len(chosen) == 1 else tuple(chosen)
                used.update(chosen)
                fired.add(idx)
    own = {logical for logical, _ in rules}
    for i, name in enumerate(names):  # a mesh-axis name without a rule: that axis
        size = mesh_sizes.get(name, 1) if name is not None and name not in own else 1
        if assigned[i] is not unset or size == 1 or name in used:
            continue
        if shape[i] % size:
            fallbacks.append(Fallback(path, i, name, name, size, int(shape[i])))
        else:
            assigned[i] = name
            used.add(name)
    spec = normalize_spec(None if a is unset else a for a in assigned)
    return Resolution(spec, frozenset(fired), frozenset(considered), tuple(fallbacks))


def fit_names(names: Sequence[str | None], shape: Sequence[int], path: str = "",
              source: str = "") -> Names:
    """``names`` padded with None to the array's rank, as Flax and JAX pad a short spec.

    More names than dims is an error (a name would point at no dim).
    """
    names = tuple(names)
    if len(names) > len(shape):
        where = f" ({source})" if source else ""
        raise ValueError(
            f"{path or '<array>'}: logical names {names}{where} have {len(names)} entries but "
            f"the array has shape {tuple(shape)} (rank {len(shape)})")
    return names + (None,) * (len(shape) - len(names))


def logical_spec(names: Sequence[str | None], shape: Sequence[int], mesh: Any,
                 rules: Sequence[Rule] = DEFAULT_RULES) -> P:
    """Resolve one array's logical names on ``mesh``; used for activations."""
    names = fit_names(names, shape, "", "logical_spec")
    return resolve(names, tuple(shape), mesh_shape(mesh), normalize_rules(rules)).spec
