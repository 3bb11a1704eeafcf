"""The memory traffic of a layer's memory-bound work, counted from its traced program.

A training step's matmuls run near the device's peak FLOP rate; the rest — norms, activation
functions, residual adds, softmax, a loss's log-softmax over the vocabulary, XLA's attention
scores — moves more bytes than it computes, so its time is its bytes at the memory bandwidth.
That is what makes a small model (d=768) slower than its FLOPs say, and XLA's attention (which
materialises the S×S scores and probabilities, forward and backward) slower than cuDNN's fused
kernel. Counted the way an optimising compiler (XLA) runs such work, as fusions:

* **fusions**: connected chains of elementwise ops, data movement and reductions. A fusion
  reads each array it takes from outside once (a matmul's or a kernel's output, another
  fusion's materialised output, the layer's inputs) and writes each array that leaves it: one
  a matmul, a kernel, a loop or the program's outputs read (saved activations included), or a
  reduction's result (a reduction ends a fusion: its consumers read it again). Parameters are
  not counted (their casts are the planner's ``fixed_memory_time``), nor fusions of only layout
  ops (reshapes, transposes and broadcasts fold into their consumers).
* **matmuls** with a thin dimension (attention's S×S products with a head's 64–128 wide
  contraction) are bound by their operands and output, not their FLOPs: each dot is listed with
  its FLOPs and bytes, and the planner charges the roofline (the larger of the two times).

Both are counted at the traced batch and at one row (:func:`linear`), so the planner scales
them to any batch. What the planner charges (jaxmp.plan.context): inside the layers, the
fusions under :data:`~jaxmp.remat.ATTENTION_SCOPE` (XLA's S×S arrays; a layer's other fusions —
norms, activations, residual adds — are what ``DeviceProfile.efficiency``, measured end to
end on transformers, already covers) and the thin matmuls' roofline; outside them (the root:
embedding, head, loss), every fusion.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from jax.extend import core as jcore

from jaxmp.cost import flops as F
from jaxmp.remat import ATTENTION_SCOPE

_DOTS = frozenset({"dot_general", "conv_general_dilated"})
_LAYOUT = frozenset("""
reshape squeeze expand_dims broadcast_in_dim transpose bitcast_convert_type sharding_constraint
copy copy_p device_put optimization_barrier stop_gradient pbroadcast mesh_cast reshard
""".split())


@dataclass(frozen=True)
class Traffic:
    """Bytes a layer's fusions move, and each matmul's (FLOPs, bytes), at one batch size."""

    fused_bytes: float
    dots: tuple[tuple[float, float], ...]
    attention_bytes: float = 0.0  # of fused_bytes, the fusions under ATTENTION_SCOPE


@dataclass(frozen=True)
class LinearTraffic:
    """:class:`Traffic` as ``constant + per_row x rows``: ``fused`` and each dot's ``flops``
    and ``bytes`` as (constant, per row) pairs."""

    fused: tuple[float, float]
    dots: tuple[tuple[tuple[float, float], tuple[float, float]], ...]
    attention: tuple[float, float] = (0.0, 0.0)

    def seconds(self, rows: float, divisor: float, rate: float, memory_bw: float,
                fused: bool = True) -> float:
        """Time beyond the FLOPs at ``rate``: the fusions' bytes (``fused=False``: only the
        attention's), and what each matmul's bytes take beyond its FLOPs, at ``memory_bw``
        (per-row parts divided by ``divisor``: the tensor split)."""
        if not memory_bw:
            return 0.0
        at = lambda pair: pair[0] + pair[1] * rows / divisor  # noqa: E731
        extra = sum(max(0.0, at(b) / memory_bw - at(f) / rate) for f, b in self.dots)
        return at(self.fused if fused else self.attention) / memory_bw + extra


def linear(at_rows: Traffic, at_one: Traffic | None, rows: int) -> LinearTraffic:
    """Fit ``constant + per_row x rows`` through the counts at ``rows`` and at one row (without
    the latter, or if the programs differ: all per row)."""
    def pair(big: float, one: float | None) -> tuple[float, float]:
        if one is None or rows <= 1:
            return 0.0, big / rows
        per = max(0.0, (big - one) / (rows - 1))
        return max(0.0, big - per * rows), per

    same = at_one is not None and len(at_one.dots) == len(at_rows.dots)
    dots = tuple((pair(f, f1 if same else None), pair(b, b1 if same else None))
                 for (f, b), (f1, b1) in zip(at_rows.dots,
                                             at_one.dots if same else at_rows.dots))
    return LinearTraffic(pair(at_rows.fused_bytes, at_one.fused_bytes if at_one else None),
                         dots, pair(at_rows.attention_bytes,
                                    at_one.attention_bytes if at_one else None))


def _nbytes(v: Any) -> float:
    aval = v.aval
    # ``dtype.itemsize``, not ``np.dtype(...)``: PRNG key arrays (dropout's ``rngs``) carry
    # extended dtypes numpy cannot interpret
    return float(math.prod(aval.shape)) * aval.dtype.itemsize \
        if hasattr(aval, "shape") and hasattr(aval, "dtype") else 0.0


@dataclass
class _Op:
    name: str
    ins: list
    outs: list
    mult: int
    eqn: Any
    stack: str


def _flatten(jaxpr: Any, mult: int, alias: dict, out: list[_Op], stack: str = "") -> None:
    """Leaf equations in program order; a call's (jit, remat, custom rules) variables renamed
    to the caller's, so values flow across it; a loop's body stays behind its boundary."""
    resolve = lambda v: alias.get(v, v)  # noqa: E731
    for eqn in jaxpr.eqns:
        own = str(eqn.source_info.name_stack)
        full = f"{stack}/{own}" if stack and own else (stack or own)
        subs = F._sub_jaxprs(eqn)
        ins = [resolve(v) for v in eqn.invars if not isinstance(v, jcore.Literal)]
        calls = [s for s in subs if s[2] == "call"]
        if not subs or eqn.primitive.name in _DOTS or F.is_kernel(eqn.primitive.name):
            out.append(_Op(eqn.primitive.name, ins, list(eqn.outvars), mult, eqn, full))
        elif calls and len(calls[0][0].invars) == len(eqn.invars):
            sub = calls[0][0]
            alias.update({i: resolve(o) for i, o in zip(sub.invars, eqn.invars)
                          if not isinstance(o, jcore.Literal)})
            _flatten(sub, mult, alias, out, full)
            alias.update({o: resolve(i) for o, i in zip(eqn.outvars, sub.outvars)
                          if not isinstance(i, jcore.Literal)})
        else:  # a loop or conditional: its operands and results cross a boundary
            out.append(_Op("boundary", ins, list(eqn.outvars), mult, eqn, full))
            body = max(subs, key=lambda s: len(s[0].eqns))
            _flatten(body[0], mult * body[1], alias, out, full)


def count(jaxpr: Any, params: Sequence[Any] = (),
          where: Callable[[str], bool] | None = None) -> Traffic:
    """:class:`Traffic` of a (closed) jaxpr; ``params``: its parameter inputs (not counted);
    ``where(name_stack)``: count only the matmuls and fusions it accepts (e.g. the root code
    outside a model's layers)."""
    if isinstance(jaxpr, jcore.ClosedJaxpr):
        jaxpr = jaxpr.jaxpr
    ops: list[_Op] = []
    alias: dict = {}
    _flatten(jaxpr, 1, alias, ops)
    resolve = lambda v: alias.get(v, v)  # noqa: E731
    outputs = {resolve(v) for v in jaxpr.outvars if not isinstance(v, jcore.Literal)}
    skip = set(params)
    producer = {v: k for k, op in enumerate(ops) for v in op.outs}
    fusible = [op.name not in _DOTS and op.name != "boundary" and not F.is_kernel(op.name)
               for op in ops]
    materialised = set(outputs)
    for k, op in enumerate(ops):
        if not fusible[k]:
            materialised.update(op.ins)
        elif op.name in F._REDUCE:
            materialised.update(op.outs)
    parent = list(range(len(ops)))

    def find(k: int) -> int:
        while parent[k] != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    for k, op in enumerate(ops):
        if not fusible[k]:
            continue
        for v in op.ins:
            p = producer.get(v)
            if p is not None and fusible[p] and v not in materialised:
                parent[find(k)] = find(p)
    groups: dict[int, list[int]] = {}
    for k in range(len(ops)):
        if fusible[k]:
            groups.setdefault(find(k), []).append(k)
    fused = attention = 0.0
    for members in groups.values():
        if all(ops[k].name in _LAYOUT for k in members) \
                or (where is not None and not any(where(ops[k].stack) for k in members)):
            continue
        inside = {v for k in members for v in ops[k].outs}
        reads = {v for k in members for v in ops[k].ins
                 if v not in inside and v not in skip}
        if not reads and any(v in skip for k in members for v in ops[k].ins):
            continue  # a parameter's cast: the planner's fixed_memory_time
        writes = {v for v in inside if v in materialised}
        mult = max(ops[k].mult for k in members)
        moved = mult * (sum(_nbytes(v) for v in reads) + sum(_nbytes(v) for v in writes))
        fused += moved
        if any(ATTENTION_SCOPE in ops[k].stack for k in members):
            attention += moved
    dots = tuple((op.mult * F.eqn_counts(op.eqn).flops,
                  op.mult * sum(_nbytes(v) for v in op.ins + op.outs))
                 for op in ops if op.name in _DOTS and (where is None or where(op.stack)))
    return Traffic(fused, dots, attention)

