"""Which parameter dims each value of a layer's program comes from, dim by dim.

The planner divides a saved activation by ``tensor`` where it is split like the weights that
made it. Matching dims by size cannot tell them apart where sizes coincide: in a model of 2-D
``nnx.Linear`` layers the query projection's output (heads × head_dim) is as wide as the
residual stream, so every norm output and residual counted as split over tensor (the research
LM at tensor 8: predicted peak −46 %, docs/planner.md §7 "Stop 35 (Rm3)"). Here each value's
dims carry the logical names (``nnx.with_partitioning``'s) of the parameter dims they derive
from, propagated through the traced program the way XLA's partitioner follows a split: a
matmul's free dims keep their operand's names and its contracted dims drop theirs (the
partial sums are all-reduced whole), elementwise operations join them, reshapes carry them to
the dims they split into or merge from. A plan then splits a value where one of its named
dims is a dim the rules split over ``tensor`` (:func:`jaxmp.plan.divisor.saved_divisor`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jax.extend import core as jcore

from jaxmp.cost import flops as F

Names = tuple[frozenset, ...]  # per dim: the logical parameter names it derives from
NONE: frozenset = frozenset()

INLINE = ("pjit", "closed_call", "core_call", "remat", "remat2", "checkpoint",
          "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr")
_REDUCE = ("reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
           "argmax", "argmin", "reduce_precision_sum")


def _shape(v: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in getattr(v.aval, "shape", ()))


def whole(shape: Sequence[int]) -> Names:
    return (NONE,) * len(shape)


def _reshape(src: Names, old: tuple[int, ...], new: tuple[int, ...]) -> Names:
    """Names across a reshape: each group of dims whose products match (the dims one dim
    splits into, or merges from) shares the names of the group's input dims."""
    out: list[frozenset] = [NONE] * len(new)
    i = j = 0
    while i < len(old) and j < len(new):
        gi, gj, pi, pj = [i], [j], old[i], new[j]
        i, j = i + 1, j + 1
        while pi != pj:
            if pi < pj and i < len(old):
                pi, i = pi * old[i], i + 1
                gi.append(i - 1)
            elif j < len(new):
                pj, j = pj * new[j], j + 1
                gj.append(j - 1)
            else:
                break
        names = frozenset().union(*(src[k] for k in gi))
        for k in gj:
            out[k] = names if new[k] > 1 else NONE
    return tuple(out)


def propagate(eqn: Any, ins: list[Names | None]) -> list[Names]:
    """The names of ``eqn``'s outputs from its operands' (None: a literal)."""
    name, p = eqn.primitive.name, eqn.params
    outs = [_shape(v) for v in eqn.outvars]
    if name == "dot_general":
        (lc, rc), (lb, rb) = p["dimension_numbers"]
        a, b = ins[0] or whole(_shape(eqn.invars[0])), ins[1] or whole(_shape(eqn.invars[1]))
        batch = [a[i] | b[j] for i, j in zip(lb, rb)]
        free_a = [a[i] for i in range(len(a)) if i not in lc and i not in lb]
        free_b = [b[j] for j in range(len(b)) if j not in rc and j not in rb]
        return [tuple(batch + free_a + free_b)]
    src = ins[0] if ins else None
    if name == "transpose" and src is not None:
        return [tuple(src[d] for d in p["permutation"])]
    if name == "broadcast_in_dim" and src is not None:
        shape_in = _shape(eqn.invars[0])
        out = [NONE] * len(outs[0])
        for k, d in enumerate(p["broadcast_dimensions"]):
            out[d] = src[k] if shape_in[k] == outs[0][d] else NONE
        return [tuple(out)]
    if name == "reshape" and src is not None:
        return [_reshape(src, _shape(eqn.invars[0]), outs[0])]
    if (name in _REDUCE or name == "squeeze") and src is not None:
        drop = set(p.get("axes", p.get("dimensions", ())))
        return [tuple(n for d, n in enumerate(src) if d not in drop)]
    result = []
    for shape in outs:  # elementwise and slicing: the operands of the same rank, joined
        same = [x for x, v in zip(ins, eqn.invars) if x is not None and len(x) == len(shape)]
        result.append(tuple(frozenset().union(*(x[d] for x in same)) if same else NONE
                            for d in range(len(shape))))
    return result


def subprogram(eqn: Any) -> Any | None:
    """The program an inlined call runs (pjit, remat, custom derivatives), else None."""
    subs = F._sub_jaxprs(eqn) if eqn.primitive.name in INLINE else []
    return subs[0][0] if subs else None


def var_names(jaxpr: Any, inputs: Sequence[Names | None]) -> dict[Any, Names]:
    """Every top-level variable of ``jaxpr`` with its names; ``inputs``: the invars' (None:
    whole). Calls are followed; loops and other control flow yield whole values."""
    if isinstance(jaxpr, jcore.ClosedJaxpr):
        jaxpr = jaxpr.jaxpr
    env = {v: (n if n is not None else whole(_shape(v))) for v, n in zip(jaxpr.invars, inputs)}
    _walk(jaxpr, env)
    return env


def _walk(jaxpr: Any, env: dict) -> None:
    for eqn in jaxpr.eqns:
        ins = [None if isinstance(v, jcore.Literal) else env.get(v) for v in eqn.invars]
        sub = subprogram(eqn)
        if sub is not None:
            inner = {sv: (n if n is not None else whole(_shape(sv)))
                     for sv, n in zip(sub.invars, ins)}
            _walk(sub, inner)
            outs = [inner.get(sv, whole(_shape(ov))) if not isinstance(sv, jcore.Literal)
                    else whole(_shape(ov)) for sv, ov in zip(sub.outvars, eqn.outvars)]
        elif F._sub_jaxprs(eqn):
            outs = [whole(_shape(v)) for v in eqn.outvars]  # scan, while, cond: whole
        else:
            outs = propagate(eqn, ins)
        env.update(zip(eqn.outvars, outs))
