"""The activation a layer's tensor all-reduce moves, read from its weight matmuls.

A tensor-parallel layer all-reduces the output of its row-parallel matmuls (forward) and the
input gradient of its column-parallel ones (backward): each is the *narrow* side of a matmul
with a weight (the split side is the wide one, the hidden or the heads). Summing the layer's
float inputs instead counts what no matmul reads (an attention's float mask: +22 % on the
research model, docs/planner.md §7 "Stop 32 (Rm)").
"""
from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
from jax.extend import core as jcore

from jaxmp.cost import flops as F

__all__ = ["matmul_activation_bytes"]


def _narrow(act: Any, out: Any) -> float:
    """The smaller side's elements in the activation's dtype (a 16-bit matmul's float32
    accumulator is cast back before it is summed)."""
    return float(min(math.prod(act.shape), math.prod(out.shape)) * np.dtype(act.dtype).itemsize)


def _walk(jaxpr: Any, weights: set, best: list[float]) -> set:
    """Mark the values computed from weights alone; collect each weight matmul's narrow
    side (the smaller of its activation operand and its output) into ``best``."""
    for eqn in jaxpr.eqns:
        ins = [v for v in eqn.invars if not isinstance(v, jcore.Literal)]
        pure = bool(ins) and all(v in weights for v in ins)
        if eqn.primitive.name == "dot_general":
            a, b = eqn.invars
            side = [v for v in (a, b) if not isinstance(v, jcore.Literal) and v not in weights]
            if len(side) == 1:  # one operand a weight, the other an activation
                best.append(_narrow(side[0].aval, eqn.outvars[0].aval))
        for sub, _, _ in F._sub_jaxprs(eqn):
            outer = list(eqn.invars)[1:] if eqn.primitive.name == "cond" else list(eqn.invars)
            inner = {s for s, o in zip(sub.invars, outer)
                     if not isinstance(o, jcore.Literal) and o in weights} \
                if len(outer) == len(sub.invars) else set()
            _walk(sub, inner, best)
        if pure:
            weights.update(eqn.outvars)
    return weights


def matmul_activation_bytes(fn: Any, params: Any, rest: Any, arrays: list) -> float:
    """Largest narrow side over the weight matmuls of ``fn(params, rest, *arrays)`` (the
    layer's forward); 0.0 when it has none (then callers keep the layer's input / output)."""
    jaxpr = jax.make_jaxpr(fn)(params, rest, *arrays).jaxpr
    n_params = len(jax.tree.leaves(params))
    best: list[float] = []
    _walk(jaxpr, set(jaxpr.invars[:n_params]), best)
    return max(best, default=0.0)
