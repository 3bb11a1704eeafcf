"""Biases split where their kernel's output is not: a naming slip that splits the residual.

A bias has its layer's output dims, so it should carry the names of the kernel's trailing
(output) dims. ``nnx.MultiHeadAttention`` takes one ``bias_init`` for all four projections: the
q/k/v biases ([heads, head_dim]) and the out projection's bias ([embed]) get the same names, so
a rule mapping the heads' name to ``tensor`` splits the out bias over ``tensor`` while its kernel
leaves that output dim whole — and XLA then keeps the residual stream split there (Stop 32,
tensor 8: +26 % bytes). :func:`split_biases` finds such biases for :func:`jaxmp.sharding.lint`.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from jax.sharding import PartitionSpec as P

# Mesh axes a weight is only stored split over: gathered whole before use (ZeRO), so a bias
# split over them splits no output. Any other axis (tensor) splits the layer's result.
STORAGE_AXES = ("fsdp", "data")


@dataclass(frozen=True)
class SplitBias:
    """A bias dim split over ``mesh_axes`` (by its name ``logical``) that its kernel does not
    split there."""

    path: str
    kernel: str
    dim: int
    logical: str | None
    mesh_axes: tuple[str, ...]
    kernel_names: tuple[str | None, ...] | None

    def message(self) -> str:
        rule = f"rule ({self.logical!r} -> {', '.join(self.mesh_axes)})"
        return (f"{self.path} is split over {', '.join(self.mesh_axes)} on dim {self.dim} by "
                f"{rule}, but the matching output dim of {self.kernel} is not: the layer's "
                f"output stays split (give the bias its kernel's output names)")


def _entries(spec: P, rank: int) -> list[tuple[str, ...]]:
    """The mesh axes of each of ``rank`` dims (() where unsplit)."""
    out = []
    for e in [*spec, *[None] * (rank - len(spec))]:
        out.append(() if e is None else (e,) if isinstance(e, str) else tuple(e))
    return out


def split_biases(leaves: Sequence[Any], specs: Sequence[P]) -> list[SplitBias]:
    """Biases (``.../bias`` beside a ``.../kernel``) whose output dims are split over a compute
    mesh axis (not in :data:`STORAGE_AXES`) the kernel's matching trailing dim is not split
    over. Dims are matched from the end
    while sizes agree, so stacked (scanned) layers' leading dim is skipped."""
    by_path = {leaf.path: (leaf, spec) for leaf, spec in zip(leaves, specs)}
    found = []
    for leaf, spec in zip(leaves, specs):
        head, _, last = leaf.path.rpartition("/")
        kernel = by_path.get(f"{head}/kernel") if last == "bias" else None
        if kernel is None:
            continue
        k_leaf, k_spec = kernel
        b_axes, k_axes = _entries(spec, len(leaf.shape)), _entries(k_spec, len(k_leaf.shape))
        for i in range(1, min(len(leaf.shape), len(k_leaf.shape)) + 1):
            if leaf.shape[-i] != k_leaf.shape[-i]:
                break
            extra = tuple(a for a in b_axes[-i]
                          if a not in k_axes[-i] and a not in STORAGE_AXES)
            if extra:
                names = leaf.names or ()
                dim = len(leaf.shape) - i
                found.append(SplitBias(leaf.path, k_leaf.path, dim,
                                       names[dim] if dim < len(names) else None, extra,
                                       k_leaf.names))
    return found
