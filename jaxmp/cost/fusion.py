"""Which saved activations survive an optimising compiler's fusion.

JAX's VJP keeps every intermediate the backward pass reads: for a GELU MLP that is the matmul
output *and* half a dozen elementwise functions of it. Inside a ``scan`` they all become loop
outputs and are materialised (stacked over layers), so there the residual list is the memory.
In straight-line code XLA fuses elementwise chains into their consumers and recomputes them in
the backward pass instead: only the *anchors* stay alive — values produced by operations that
do not fuse (matmuls, convolutions, reductions, gathers, calls, library kernels such as cuDNN's
fused attention) and the layer's inputs.

``kept_values`` maps a residual list to those anchors by walking back through fusible
producers. It needs a flat jaxpr (trace under ``jax.disable_jit()`` so jitted helpers inline).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from jax.extend import core as jcore

from jaxmp.cost import flops as F

_ANCHORS = frozenset("""
dot_general conv_general_dilated gather scatter scatter-add scatter_add scatter_mul scatter_min
scatter_max sort argsort dynamic_update_slice custom_jvp_call custom_vjp_call
custom_vjp_call_jaxpr pjit closed_call scan while cond remat remat2 checkpoint shard_map
""".split()) | F._REDUCE


def _fusible(eqn: Any) -> bool:
    name = eqn.primitive.name
    return name not in _ANCHORS and not F.is_kernel(name) and not F._sub_jaxprs(eqn)


def kept_values(jaxpr: Any, residuals: Sequence[Any], exclude: Iterable[Any] = (),
                forward_end: int = 0) -> list[Any]:
    """The anchor variables the ``residuals`` are recomputable from, in program order.

    A value is an anchor if a non-fusible operation produces it, or if one of the first
    ``forward_end`` equations (the forward pass) reads it with a non-fusible operation: the
    forward pass materialises it anyway, and the compiler keeps it rather than recompute.
    ``exclude`` (e.g. the parameter inputs) are never reported: they are stored anyway.
    """
    if isinstance(jaxpr, jcore.ClosedJaxpr):
        jaxpr = jaxpr.jaxpr
    producer = {v: e for e in jaxpr.eqns for v in e.outvars}
    read_whole = {v for e in jaxpr.eqns[:forward_end] if not _fusible(e)
                  for v in e.invars if not isinstance(v, jcore.Literal)}
    order = {v: i for i, v in enumerate(list(jaxpr.invars)
                                        + [v for e in jaxpr.eqns for v in e.outvars])}
    sources: dict[Any, frozenset] = {}

    def anchors_of(root: Any) -> frozenset:
        stack = [root]
        while stack:  # iterative post-order: elementwise chains can be long
            v = stack[-1]
            if v in sources:
                stack.pop()
                continue
            e = producer.get(v)
            if e is None or not _fusible(e) or v in read_whole:
                sources[v] = frozenset([v])
                stack.pop()
                continue
            pending = [i for i in e.invars
                       if not isinstance(i, jcore.Literal) and i not in sources]
            if pending:
                stack.extend(pending)
                continue
            sources[v] = frozenset().union(*(sources[i] for i in e.invars
                                             if not isinstance(i, jcore.Literal)))
            stack.pop()
        return sources[root]

    kept: set = set()
    for r in residuals:
        if not isinstance(r, jcore.Literal):
            kept |= anchors_of(r)
    kept -= set(exclude)
    return sorted(kept, key=lambda v: order.get(v, -1))


def grouped_scores(shapes: Sequence[tuple[int, ...]], batch_dims: Sequence[int | None],
                   seq: int) -> bool:
    """Whether any of these arrays is grouped-query attention's scores: ``[..., seq, seq]``
    with two dims besides the batch's above one (XLA's ``[kv_heads, group]`` pair)."""
    return any(len(s) >= 4 and s[-2:] == (seq, seq)
               and sum(d > 1 for k, d in enumerate(s[:-2]) if k != b) >= 2
               for s, b in zip(shapes, batch_dims))
