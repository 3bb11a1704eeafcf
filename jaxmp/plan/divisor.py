"""What divides a layer's activation over ``tensor``: the planner's per-array divisor.

An activation is split over ``tensor`` where one of its dims is a dim a tensor-split weight
has (heads, mlp, vocab) or, under sequence parallelism, the sequence right after the batch.
Grouped-query attention in XLA reshapes the query heads into ``[kv_heads, group]``
(``jax.nn.dot_product_attention``: scores ``[batch, kv_heads, group, seq, seq]``): where the kv
heads do not divide over ``tensor`` but the heads do, XLA splits that pair as it splits the
heads, so two adjacent dims whose product is a split dim count too (kv heads 2, heads 12 on
tensor 4: the f32 scores were counted whole, +124 % peak, docs/planner.md "Stop 32 (Sw)").
"""

from __future__ import annotations

import math
from collections.abc import Callable


def saved_divisor(tdims: frozenset[int], tensor: int, seq: int = 0,
                  split_names: frozenset[str] | None = None) -> Callable[..., int]:
    """``divisor(shape, batch_dim, names=None)``: ``tensor`` where the array splits over it,
    else 1. ``tdims``: the sizes of the dims tensor-split weights split; ``split_names``:
    their logical names; ``seq``: the sequence length with sequence parallelism (0 off),
    whose dim right after the batch dim is split; ``names``: the array's per-dim parameter
    names (:mod:`jaxmp.cost.splits`), None where not traced."""
    def split_dim(size: int) -> bool:
        return size in tdims and size % tensor == 0

    def named(shape: tuple, bdim: int | None, names: tuple) -> bool:
        sizes = [s for dim, (s, n) in enumerate(zip(shape, names))
                 if dim != bdim and n & split_names]
        return bool(sizes) and math.prod(sizes) % tensor == 0

    def divisor(shape: tuple, bdim: int | None, names: tuple | None = None) -> int:
        if tensor <= 1:
            return 1
        seq_split = seq and bdim is not None and len(shape) > bdim + 1 and \
            shape[bdim + 1] == seq and seq % tensor == 0
        if names is not None and split_names is not None:
            return tensor if seq_split or named(shape, bdim, names) else 1
        dims = [s for dim, s in enumerate(shape) if dim != bdim]
        hit = any(split_dim(s) for s in dims)
        # a split dim factored into two (GQA's [kv_heads, group]); not the last dim, whose
        # product with its neighbour is a head's width, not a head count
        inner = [s for dim, s in enumerate(shape[:-1]) if dim != bdim]
        pair = any(a > 1 and b > 1 and split_dim(a * b) for a, b in zip(inner, inner[1:]))
        return tensor if hit or pair or seq_split else 1

    return divisor
