"""Activation sharding by logical name: model code calls :func:`constrain`; the trainer decides
whether it means anything by entering :func:`activation_sharding` around tracing."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxmp.mesh import current_mesh, manual_axes, shard_map_over
from jaxmp.sharding.resolve import (DEFAULT_RULES, Rule, logical_spec, normalize_rules,
                                    resolve)

_SEEN: contextvars.ContextVar[set[str] | None] = contextvars.ContextVar(
    "jaxmp_activation_names", default=None)
_ACTIVE: contextvars.ContextVar[tuple[Any, tuple[Rule, ...]] | None] = contextvars.ContextVar(
    "jaxmp_activation_sharding", default=None)


@contextlib.contextmanager
def activation_sharding(mesh: Mesh, rules: Sequence[Rule] = DEFAULT_RULES) -> Iterator[None]:
    """Make :func:`constrain` apply sharding constraints on ``mesh`` while tracing inside.

    The context is read at trace time and is not part of jit's cache key: enter it around the
    first call (trace) of a jitted function, not around a later cached call.
    """
    token = _ACTIVE.set((mesh, normalize_rules(rules)))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active() -> tuple[Any, tuple[Rule, ...]] | None:
    """The ``(mesh, rules)`` of the enclosing :func:`activation_sharding`, or None: for code
    that shapes its own ``shard_map`` from them (``jaxmp.sharding.ring``)."""
    return _ACTIVE.get()


@contextlib.contextmanager
def recording_names() -> Iterator[set[str]]:
    """Collect the logical names :func:`constrain` is called with while tracing inside (the
    cost model asks whether a model names its sequence dim: what sequence parallelism
    needs)."""
    seen: set[str] = set()
    token = _SEEN.set(seen)
    try:
        yield seen
    finally:
        _SEEN.reset(token)


def named(mesh: Mesh, spec: Any) -> NamedSharding:
    """``NamedSharding`` for a constraint traced now (see :func:`current_mesh`)."""
    return NamedSharding(current_mesh(mesh), spec)


def constrain(x: Any, names: Sequence[str | None]) -> Any:
    """Constrain activation ``x`` by logical names; identity outside :func:`activation_sharding`.

    Keeps model code runnable on one device and in tests without any mesh.
    """
    seen = _SEEN.get()
    if seen is not None:
        seen.update(n for n in names if n is not None)
    active = _ACTIVE.get()
    if active is None:
        return x
    mesh, rules = active
    spec = logical_spec(names, np.shape(x), mesh, rules)
    return jax.lax.with_sharding_constraint(x, named(mesh, spec))


def splits(shape: Sequence[int], names: Sequence[str | None], dim: int) -> bool:
    """Whether an activation of ``shape`` named ``names`` is split along ``dim`` by the rules
    active now (False outside :func:`activation_sharding`): e.g. the residual stream's
    sequence under sequence parallelism."""
    active = _ACTIVE.get()
    if active is None:
        return False
    mesh, rules = active
    spec = logical_spec(names, tuple(shape), mesh, rules)
    return len(spec) > dim and spec[dim] is not None


def spec_without(spec: Sequence[Any], axis: str) -> P:
    """``spec`` (a PartitionSpec's entries) with mesh axis ``axis`` removed from every dim:
    the sharding an array has once gathered over ``axis``."""
    def without(entry: Any) -> Any:
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        kept = tuple(a for a in axes if a != axis)
        return None if not kept else kept[0] if len(kept) == 1 else kept

    return P(*(without(e) for e in spec))


def gathered(x: Any, names: Sequence[str | None], axis: str = "fsdp") -> Any:
    """``x`` constrained to its logical names' sharding less mesh axis ``axis``: the partitioner
    gathers it over ``axis`` here (a weight first used inside a ``lax.cond`` is otherwise
    gathered inside the branch, where XLA's scheduler overlaps no compute with the transfer:
    the pipeline's ticks). Its transpose gathers the cotangent too: pin gradients to the
    weight's own names after it. Identity outside :func:`activation_sharding`."""
    active = _ACTIVE.get()
    if active is None:
        return x
    mesh, rules = active
    spec = logical_spec(names, np.shape(x), mesh, rules)
    return jax.lax.with_sharding_constraint(x, named(mesh, spec_without(spec, axis)))


def moved(x: Any, names: Sequence[str | None], dim: int, axis: str = "fsdp") -> Any:
    """``x`` constrained to its logical names' sharding with mesh axis ``axis`` moved from
    whichever dim holds it to ``dim`` (the partitioner reshards with an all-to-all: ``1/n`` of
    an all-gather's bytes); as :func:`constrain` where ``dim`` does not divide by it."""
    active = _ACTIVE.get()
    if active is None:
        return x
    mesh, rules = active
    spec = logical_spec(names, np.shape(x), mesh, rules)
    n = dict(mesh.shape).get(axis, 1)
    held = any(axis in ((e,) if isinstance(e, str) else tuple(e or ())) for e in spec)
    if n == 1 or not held or np.shape(x)[dim] % n:
        return jax.lax.with_sharding_constraint(x, named(mesh, spec))
    entries = list(spec_without(spec, axis)) + [None] * (np.ndim(x) - len(spec))
    entries[dim] = axis if entries[dim] is None else tuple(
        (entries[dim],) if isinstance(entries[dim], str) else entries[dim]) + (axis,)
    return jax.lax.with_sharding_constraint(x, named(mesh, P(*entries)))


def _local_axes() -> tuple[Mesh, Any, dict[str, int], set[str]] | None:
    """The mesh and rules traced now, each axis's size as :func:`local` splits by (1 where an
    enclosing ``shard_map`` made it manual) and the axes still automatic; None where
    :func:`local` makes a plain call."""
    active = _ACTIVE.get()
    if active is None:
        return None
    mesh, rules = active
    manual = manual_axes(mesh)
    sizes = {a: (1 if a in manual else int(n)) for a, n in dict(mesh.shape).items()}
    # every axis not yet manual, size 1 too: jax lowers a custom-partitioning op as a plain
    # call only where all of the mesh's axes are manual (jax/_src/custom_partitioning.py)
    auto = set(sizes) - manual
    if not auto or all(sizes[a] == 1 for a in auto) and not manual:
        return None
    return mesh, rules, sizes, auto


def local_specs(shapes: Sequence[Sequence[int]], names: Sequence[Sequence[str | None]]
                ) -> list[P] | None:
    """The PartitionSpecs :func:`local` would split arrays of ``shapes`` by (None: a plain
    call), for a caller that must know whether two operands split alike."""
    found = _local_axes()
    if found is None:
        return None
    _, rules, sizes, _ = found
    return [resolve(tuple(n), tuple(s), sizes, rules).spec
            for n, s in zip(names, shapes, strict=True)]


def local(fn: Callable[..., Any], args: Sequence[Any], in_names: Sequence[Sequence[str | None]],
          out_names: Sequence[str | None]) -> Any:
    """``fn(*args)`` (one array out) run on local arrays: a ``shard_map`` over the mesh axes
    still automatic where this is traced (all of them, or those an enclosing ``shard_map`` over
    part of the mesh left, e.g. the pipeline's over ``stage``), each array split as its logical
    names resolve on those axes. For an op that partitions itself (jax's cuDNN attention, a
    custom-partitioning op) and cannot inside a shard_map over part of the mesh. A plain call
    outside :func:`activation_sharding` or where no mesh axis is left automatic. jax's
    varying-axes check is on: an array an axis does not split (heads that do not divide over
    ``tensor``) is the same on each of its devices, so its gradient is not summed over it
    (without the check jax all-reduced those gradients, a collective per layer)."""
    found = _local_axes()
    if found is None:
        return fn(*args)
    mesh, _, _, auto = found
    in_specs = tuple(local_specs([np.shape(a) for a in args], in_names))
    out_shape = jax.eval_shape(fn, *args).shape
    (out_spec,) = local_specs([out_shape], [out_names])
    return shard_map_over(fn, mesh, auto, in_specs, out_spec, check_vma=True)(*args)
