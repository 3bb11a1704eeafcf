"""FLOPs counted from a traced program (a jaxpr), attributable to named scopes.

Why count the jaxpr instead of asking XLA: ``compiled.cost_analysis()`` needs a compile (slow for
large models, impossible for a 1024-device plan on a laptop) and counts a ``scan`` / ``while``
body once however many times it runs. Here every equation is visited once with its *trip
multiplier* (scan length, nested), and each one carries its cumulative name stack, so a caller
that wraps layers in ``jax.named_scope`` can attribute every FLOP to a layer and to the forward
or backward pass (backward equations sit under ``transpose(...)``).

Conventions follow XLA's HloCostAnalysis so the two can be compared:

* ``dot_general`` 2·batch·M·N·K and convolutions 2·out·(in/groups)·window — exact;
* elementwise arithmetic, comparisons and selects: one FLOP per output element;
* transcendental functions (exp, log, tanh, rsqrt, ...) go to ``transcendentals``, not ``flops``;
* reductions: one FLOP per input element; scatter-add: one per update element;
* data movement (reshape, transpose, gather, slices, converts, ...) is free;
* a fused attention kernel (cuDNN's, ``dot_product_attention_*``) counts the matmuls of the
  attention it replaces, full square as XLA's attention computes it (and as MFU counts it):
  4·B·N·T·S·H forward, 8·B·N·T·S·H backward, B·N·T·S exponentials each way. The kernel's
  own work differs (it skips masked tiles and recomputes scores); the convention keeps a
  model's FLOPs independent of its attention kernel. What a causal kernel skips (the matmuls of
  the masked upper triangle) is counted apart, in ``skipped``: the planner's time model charges
  only the work the kernel runs.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from jax.extend import core as jcore

_FREE = frozenset("""
reshape broadcast_in_dim transpose squeeze expand_dims slice dynamic_slice dynamic_update_slice
concatenate pad gather rev convert_element_type bitcast_convert_type iota copy copy_p
sharding_constraint device_put mesh_cast reshard optimization_barrier split stop_gradient
random_bits random_seed random_wrap random_unwrap random_fold_in random_split threefry2x32
select_and_gather_add reduce_precision axis_index psum pmax pmin all_gather all_to_all ppermute
reduce_scatter psum_scatter pbroadcast empty
""".split())
_TRANSCENDENTAL = frozenset("""
exp exp2 log log1p expm1 tanh logistic sin cos tan asin acos atan atan2 sinh cosh asinh acosh
atanh erf erfc erf_inv lgamma digamma igamma pow sqrt rsqrt cbrt
""".split())
_REDUCE = frozenset("""
reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or reduce_xor argmax argmin
cumsum cumprod cummax cummin cumlogsumexp reduce
""".split())
_SCATTER = frozenset("scatter scatter-add scatter_add scatter_mul scatter_min scatter_max".split())


@dataclass
class Counts:
    """FLOPs and transcendental ops of (part of) a program, per execution."""

    flops: float = 0.0
    transcendentals: float = 0.0
    skipped: float = 0.0  # of ``flops``: masked work a fused kernel does not run

    def __iadd__(self, other: Counts) -> Counts:
        self.flops += other.flops
        self.transcendentals += other.transcendentals
        self.skipped += other.skipped
        return self

    def scaled(self, k: float) -> Counts:
        return Counts(self.flops * k, self.transcendentals * k, self.skipped * k)

    @property
    def total(self) -> float:
        return self.flops + self.transcendentals


@dataclass
class LeafEqn:
    """One primitive equation of the flattened program with what a caller attributes it by."""

    eqn: Any
    multiplier: int  # executions per program run (product of enclosing scan lengths)
    name_stack: str  # cumulative, e.g. "transpose(jvp(layer:blocks))/attn"
    counts: Counts
    reads: frozenset = frozenset()  # tags of the values it reads (see iter_eqns)


@dataclass
class FlopReport:
    total: Counts = field(default_factory=Counts)
    warnings: list[str] = field(default_factory=list)


def _size(aval: Any) -> int:
    return int(math.prod(getattr(aval, "shape", ())))


def _is_float(aval: Any) -> bool:
    dtype = getattr(aval, "dtype", None)
    return dtype is not None and np.issubdtype(np.dtype(dtype), np.inexact)


def is_kernel(name: str) -> bool:
    """A primitive that runs as one library kernel (cuDNN's fused attention, forward or
    backward): opaque, never fused with its neighbours, its outputs always materialised."""
    return name.startswith("dot_product_attention")


def _fused_attention_counts(eqn: Any) -> Counts:
    """See the module docstring. Operands: query, key, value first; layout 0 is
    [batch, seq, heads, head_dim], 1 is [batch, heads, seq, head_dim]."""
    q, k = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
    bnth = eqn.params.get("layout", 0) in (1, "BNTH")
    b, n, t, h = (q[0], q[1], q[2], q[3]) if bnth else (q[0], q[2], q[1], q[3])
    s = k[2] if bnth else k[1]
    pairs = float(b * n * t * s)
    per_pair = (8.0 if "bwd" in eqn.primitive.name else 4.0) * h
    # A causal kernel skips the query-key pairs above the diagonal (t = s: t(t-1)/2 per head).
    causal = "CAUSAL" in str(eqn.params.get("mask_type", "")) and t == s
    masked = float(b * n * t * (t - 1) / 2) if causal else 0.0
    return Counts(per_pair * pairs, pairs, per_pair * masked)


def eqn_counts(eqn: Any) -> Counts:
    """Counts of one primitive equation (not recursing into sub-programs)."""
    name = eqn.primitive.name
    outs = [v.aval for v in eqn.outvars]
    ins = [v.aval for v in eqn.invars]
    out_size = sum(_size(a) for a in outs)
    if is_kernel(name):
        return _fused_attention_counts(eqn)
    if name == "dot_general":
        (lhs_contract, _), _ = eqn.params["dimension_numbers"]
        k = math.prod(ins[0].shape[d] for d in lhs_contract)
        return Counts(2.0 * out_size * k)
    if name == "conv_general_dilated":
        rhs = ins[1].shape
        dn = eqn.params["dimension_numbers"]
        spec = getattr(dn, "rhs_spec", None) or (0, 1) + tuple(range(2, len(rhs)))
        window = math.prod(rhs[d] for d in spec[2:])
        in_feat = rhs[spec[1]]  # kernel's input features are already divided by groups
        return Counts(2.0 * out_size * in_feat * window)
    if name in _FREE:
        return Counts()
    if name in _TRANSCENDENTAL:
        return Counts(0.0, float(out_size))
    if name in _REDUCE:
        return Counts(float(sum(_size(a) for a in ins[: max(1, len(ins) // 2)])))
    if name in _SCATTER:
        return Counts(float(_size(ins[-1]))) if name != "scatter" else Counts()
    if name == "integer_pow":
        return Counts(float(out_size * max(1, abs(int(eqn.params.get("y", 2))) - 1)))
    if name == "sort":
        dim = eqn.params.get("dimension", -1)
        n = ins[0].shape[dim] if ins and ins[0].shape else 1
        return Counts(float(_size(ins[0]) * max(1.0, math.log2(max(n, 2)))))
    if name in ("custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"):
        return Counts()  # containers: their bodies are visited
    # Everything else elementwise-like (add, mul, select_n, comparisons, max, neg, ...).
    if outs and (_is_float(outs[0]) or name in ("select_n", "eq", "ne", "lt", "le", "gt", "ge",
                                                  "and", "or", "not", "xor", "clamp")):
        return Counts(float(out_size))
    return Counts()


def _sub_jaxprs(eqn: Any) -> list[tuple[Any, int, str]]:
    """(jaxpr, multiplier, kind) for the programs an equation runs."""
    name = eqn.primitive.name
    out = []
    for key, val in eqn.params.items():
        vals = val if isinstance(val, (tuple, list)) else (val,)
        for v in vals:
            jaxpr = v.jaxpr if isinstance(v, jcore.ClosedJaxpr) else v
            if isinstance(jaxpr, jcore.Jaxpr):
                if name == "scan" and key == "jaxpr":
                    out.append((jaxpr, int(eqn.params["length"]), "scan"))
                elif name == "cond" and key == "branches":
                    out.append((jaxpr, 1, "branch"))
                elif name == "while":
                    out.append((jaxpr, 1, "while-" + key))
                elif key in ("fwd_jaxpr_thunk", "bwd"):
                    continue
                else:
                    out.append((jaxpr, 1, "call"))
    if name in ("custom_vjp_call", "custom_vjp_call_jaxpr"):
        out = [o for o in out if o[2] == "call"][:1]  # the primal function only
    if name == "custom_jvp_call":
        out = out[:1]
    return out


_ALIASING = _FREE - {"gather", "dynamic_slice", "slice", "concatenate", "pad", "iota"}


def _inner_tags(eqn: Any, sub: Any, tags: dict) -> dict:
    """Tags of a sub-program's inputs, passed positionally from the equation's operands."""
    outer = list(eqn.invars)[1:] if eqn.primitive.name == "cond" else list(eqn.invars)
    if len(outer) != len(sub.invars):
        return {}
    return {v: tags[o] for v, o in zip(sub.invars, outer)
            if not isinstance(o, jcore.Literal) and o in tags}


def iter_eqns(jaxpr: Any, multiplier: int = 1, stack: str = "",
              warnings: list[str] | None = None,
              tags: dict | None = None) -> Iterator[LeafEqn]:
    """Every primitive equation of ``jaxpr``, depth first in program order.

    Call-like primitives (jit, custom_jvp, remat, shard_map, ...) are inlined; scan bodies get
    their length as multiplier; of a ``cond`` only the most expensive branch is kept (an upper
    bound); a ``while`` body of unknown trip count is counted once, with a warning.

    ``tags`` maps input variables to sets of labels (e.g. parameter indices); labels follow
    values through calls and data movement, and each :class:`LeafEqn` lists those it reads.
    """
    if isinstance(jaxpr, jcore.ClosedJaxpr):
        jaxpr = jaxpr.jaxpr
    tags = dict(tags or {})
    for eqn in jaxpr.eqns:
        yield from iter_eqn(eqn, multiplier, stack, warnings, tags)


def iter_eqn(eqn: Any, multiplier: int = 1, stack: str = "",
             warnings: list[str] | None = None, tags: dict | None = None) -> Iterator[LeafEqn]:
    """The primitive equations of one equation (itself, or those of the programs it runs)."""
    tags = {} if tags is None else tags
    own = str(eqn.source_info.name_stack)
    full = f"{stack}/{own}" if stack and own else (stack or own)
    read = frozenset().union(*(tags.get(v, frozenset()) for v in eqn.invars
                               if not isinstance(v, jcore.Literal)))
    subs = _sub_jaxprs(eqn)
    if not subs:
        if read and eqn.primitive.name in _ALIASING:
            tags.update({o: read for o in eqn.outvars})
        yield LeafEqn(eqn, multiplier, full, eqn_counts(eqn), read)
        return
    if eqn.primitive.name == "cond":
        branches = [list(iter_eqns(j, multiplier, full, warnings, _inner_tags(eqn, j, tags)))
                    for j, _, _ in subs]
        yield from max(branches, key=lambda b: sum(e.counts.total * e.multiplier for e in b))
        return
    if eqn.primitive.name == "while" and warnings is not None:
        warnings.append(f"while loop at {full or '<top>'}: trip count unknown, body counted once")
    for sub, mult, _ in subs:
        yield from iter_eqns(sub, multiplier * mult, full, warnings, _inner_tags(eqn, sub, tags))


def count_jaxpr(jaxpr: Any) -> FlopReport:
    """Total counts of a (closed) jaxpr, loop trip counts included."""
    report = FlopReport()
    for leaf in iter_eqns(jaxpr, warnings=report.warnings):
        report.total += leaf.counts.scaled(leaf.multiplier)
    return report


def is_backward(name_stack: str) -> bool:
    """Equations of a VJP's backward pass carry ``transpose(...)`` in their name stack."""
    return "transpose(" in name_stack
