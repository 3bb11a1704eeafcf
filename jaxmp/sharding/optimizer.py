"""Optimizer state sharded over the data axis as well (ZeRO-1): where each array's extra cut goes.

Each data replica holds a full copy of the parameters it computes with, but the optimizer's
moments (and the update it computes) need only live once per replica group: device ``d`` of
the data axis keeps the ``d``-th slice. This module says which slice, as a PartitionSpec: the
array's own spec (what fsdp / tensor / stage already cut) with ``data`` appended to one dim —
the largest one whose local size ``data`` divides. Appended *after* the axes already on that
dim, so a device's data slice is a sub-block of the block it already holds: a
``psum_scatter`` of its local block over ``data`` (:mod:`jaxmp.compression.reduce`) lands
exactly on it. An array no dim of which ``data`` divides (a scalar, a tiny bias) stays as it is.
"""

from __future__ import annotations

from collections.abc import Sequence

from jax.sharding import PartitionSpec as P

DATA = "data"


def _axes(entry: str | Sequence[str] | None) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def data_dim(spec: P, shape: Sequence[int], sizes: dict[str, int]) -> int | None:
    """The dim ``data`` is appended to (None: the array stays replicated over data)."""
    data = int(sizes.get(DATA, 1))
    entries = tuple(spec) + (None,) * (len(shape) - len(spec))
    if data <= 1 or any(DATA in _axes(e) for e in entries):
        return None
    best, best_local = None, 0
    for d, (n, e) in enumerate(zip(shape, entries)):
        div = 1
        for a in _axes(e):
            div *= int(sizes[a])
        local = n // div
        if local % data == 0 and local > best_local:
            best, best_local = d, local
    return best


def over_data(spec: P, shape: Sequence[int], sizes: dict[str, int]) -> P:
    """``spec`` with ``data`` added as the innermost cut of :func:`data_dim`'s dim."""
    d = data_dim(spec, shape, sizes)
    if d is None:
        return spec
    entries = list(tuple(spec) + (None,) * (len(shape) - len(spec)))
    axes = _axes(entries[d]) + (DATA,)
    entries[d] = axes[0] if len(axes) == 1 else axes
    return P(*entries)
