"""Peak memory of a layer's backward pass, by liveness over its (flattened) program.

The backward pass of one layer needs memory beyond the activations saved for it: recomputed
activations under remat, gradients of its intermediates (an attention layer's score gradients
are as large as its scores), its input gradient. Compilers fuse elementwise chains, so the
simulation materialises a value only when a non-fusible operation (matmul, reduction, gather,
...) produces or reads it, or it is an output; a fused chain is read where its consumer runs.
Each materialised value lives from its definition to its last read, in program order. The
result is the largest sum of live values during the backward pass, excluding the parameters,
the saved activations and the parameter gradients (which the caller accounts for).

Sequence parallelism splits the residual stream's sequence over ``tensor``, but not where a
matmul meets it: a column-parallel matmul reads its input gathered whole, a row-parallel one
writes its partial sums whole before the reduce-scatter, and the backward pass does the same
with the gradients and gathers the saved input of each weight gradient again. The timeline
marks those values (:attr:`Timeline.matmul`) so a layout's peak can count them whole.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from jax.extend import core as jcore

from jaxmp._util.arrays import nbytes as _nbytes
from jaxmp.cost import flops as F
from jaxmp.cost.fusion import _fusible
from jaxmp.cost.splits import Names, propagate, subprogram, whole


@dataclass
class _Node:
    fusible: bool
    ins: list[int]
    outs: list[int]
    backward: bool
    matmul: bool = False


class _Flat:
    """A program flattened into nodes over integer value ids (calls inlined)."""

    def __init__(self) -> None:
        self.nodes: list[_Node] = []
        self.size: dict[int, int] = {}
        self.shape: dict[int, tuple[int, ...]] = {}
        self.names: dict[int, Names] = {}  # per dim, the parameter names (cost.splits)
        self._next = 0

    def new(self, aval: Any, names: Names | None = None) -> int:
        self._next += 1
        self.size[self._next] = _nbytes(aval)
        self.shape[self._next] = tuple(int(d) for d in getattr(aval, "shape", ()))
        self.names[self._next] = names if names is not None else whole(self.shape[self._next])
        return self._next

    def add(self, jaxpr: Any, env: dict, stack: str) -> None:
        for eqn in jaxpr.eqns:
            own = str(eqn.source_info.name_stack)
            full = f"{stack}/{own}" if stack and own else (stack or own)
            ins = [env[v] for v in eqn.invars if not isinstance(v, jcore.Literal) and v in env]
            subs = F._sub_jaxprs(eqn)
            sub = subprogram(eqn)
            if sub is not None:
                inner = {sv: env[ov] for sv, ov in zip(sub.invars, eqn.invars)
                         if not isinstance(ov, jcore.Literal) and ov in env}
                for sv in sub.invars:
                    inner.setdefault(sv, self.new(sv.aval))
                self.add(sub, inner, full)
                for ov, sv in zip(eqn.outvars, sub.outvars):
                    env[ov] = inner[sv] if not isinstance(sv, jcore.Literal) and sv in inner \
                        else self.new(ov.aval)
                continue
            names = propagate(eqn, [None if isinstance(v, jcore.Literal) or v not in env
                                    else self.names[env[v]] for v in eqn.invars]) \
                if not subs else [None] * len(eqn.outvars)  # loops: whole
            outs = [self.new(v.aval, n) for v, n in zip(eqn.outvars, names)]
            env.update(zip(eqn.outvars, outs))
            fusible = _fusible(eqn)
            self.nodes.append(_Node(fusible, ins, outs, F.is_backward(full),
                                    eqn.primitive.name == "dot_general"))


MATMUL, GATHERED = 1, 2  # Timeline.matmul kinds


@dataclass(frozen=True)
class Timeline:
    """Materialised values of a program as live intervals ``[start, stop]`` over its steps.

    Kept per value (shape, batch dim) rather than as one number, so the peak can be taken per
    candidate layout: rows per device scale batch dims, the tensor axis splits some values.
    """

    starts: tuple[int, ...]
    stops: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]
    itemsizes: tuple[int, ...]
    batch_dims: tuple[int | None, ...]
    rows: int
    backward_start: int
    steps: int
    # Per value: 0, or MATMUL (a matmul's operand or result), or GATHERED (a copy of a saved
    # activation a backward matmul reads, which exists only where the sequence is split).
    matmul: tuple[int, ...] = ()
    names: tuple = ()  # per value, its dims' parameter names (cost.splits); (): not traced

    def with_batch_dims(self, one_row: Timeline | None) -> Timeline:
        """Batch dims from the same program traced at one row (values match by position)."""
        if one_row is None or one_row.shapes.__len__() != len(self.shapes):
            bdims = tuple(s.index(self.rows) if self.rows in s else None for s in self.shapes)
        else:
            bdims = tuple(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
                          for a, b in zip(self.shapes, one_row.shapes))
        return Timeline(self.starts, self.stops, self.shapes, self.itemsizes, bdims,
                        self.rows, self.backward_start, self.steps, self.matmul, self.names)

    def peak(self, rows: float, divisor: Any = None, upcast_16bit: bool = False) -> float:
        """Largest live bytes during the backward pass at ``rows`` batch rows, each value
        divided by ``divisor(shape, batch_dim)`` (e.g. the tensor axis); ``upcast_16bit``
        counts 16-bit values as float32."""
        return self.peak_of(self.sizes(divisor, upcast_16bit), rows)

    def sizes(self, divisor: Any = None, upcast_16bit: bool = False, whole: Any = None,
              regather: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Each value's (constant bytes, bytes per batch row): what :meth:`peak_of` needs.
        ``whole``: with the sequence split by ``divisor`` (sequence parallelism), the divisor
        without that split, for the values beside matmuls (None: the sequence is whole);
        ``regather``: the backend gathers the saved inputs of weight gradients again
        (:func:`jaxmp.plan.sequence.regathers`)."""
        const, per_row = np.zeros(len(self.shapes)), np.zeros(len(self.shapes))
        kinds = self.matmul or (0,) * len(self.shapes)
        for k, (shape, item, bdim, kind) in enumerate(zip(self.shapes, self.itemsizes,
                                                          self.batch_dims, kinds)):
            item = 4 if upcast_16bit and item == 2 else item
            names = self.names[k] if self.names else None
            div = divisor(shape, bdim, names) if divisor else 1
            if kind:
                split = whole is not None and whole(shape, bdim, names) != div
                if kind == GATHERED and not (split and regather):
                    continue  # stored whole or split by heads: used in place
                div = whole(shape, bdim, names) if split else div
            size = math.prod(shape) * item / div
            if bdim is None:
                const[k] = size
            else:
                per_row[k] = size / self.rows
        return const, per_row

    def held_together(self, seq: int) -> Timeline:
        """This timeline with the backward's score-sized matmul operands and results
        (``[..., seq, seq]``: XLA attention's scores, probabilities and their gradients) each
        live until the last of them is read. XLA's GPU fusion of the softmax backward
        recomputes the probabilities from the raw scores, so the recomputed scores, the
        probabilities, their gradient and the scores' gradient are live at once
        (docs/planner.md §7, "Stop 31")."""
        kinds = self.matmul or (0,) * len(self.shapes)
        scores = [k for k, (shape, kind) in enumerate(zip(self.shapes, kinds))
                  if kind == MATMUL and len(shape) >= 2 and shape[-2:] == (seq, seq)
                  and self.stops[k] >= self.backward_start]
        if not seq or len(scores) < 2:
            return self
        last = max(self.stops[k] for k in scores)
        stops = list(self.stops)
        for k in scores:
            stops[k] = last
        return Timeline(self.starts, tuple(stops), self.shapes, self.itemsizes,
                        self.batch_dims, self.rows, self.backward_start, self.steps,
                        self.matmul, self.names)

    def peak_of(self, sizes: tuple[np.ndarray, np.ndarray], rows: float,
                forward: bool = False) -> float:
        """The largest live bytes in the backward pass (``forward``: before it)."""
        lo, hi = (0, self.backward_start) if forward else (self.backward_start, self.steps)
        if lo >= hi or not self.shapes:
            return 0.0
        weight = sizes[0] + sizes[1] * rows
        n = self.steps + 2
        delta = (np.bincount(self.starts, weight, n)
                 - np.bincount(np.asarray(self.stops) + 1, weight, n))
        return float(np.cumsum(delta)[lo:hi].max())


def backward_timeline(jaxpr: Any, exclude: list[Any], live_inputs: list[Any] = (),
                      primal_outputs: list[Any] = (), rows: int = 1,
                      input_names: list[Names | None] = (), kept: list[Any] = (),
                      hoist: bool = False) -> Timeline:
    """The live intervals of ``jaxpr``'s materialised values (see the module docstring).

    ``exclude`` are values accounted for elsewhere (residuals, parameter gradients, the
    primal output); of the inputs only ``live_inputs`` (the incoming gradients) count. The
    backward pass starts after the last of ``primal_outputs`` is computed (a VJP program runs
    the whole forward first; under remat its backward equations are not marked as such).
    ``input_names``: the invars' per-dim parameter names (:mod:`jaxmp.cost.splits`).
    ``kept`` live to the end (a loop body's residuals, copied into their stacks at its end);
    ``hoist``: the values the forward reads that no input feeds (masks, broadcast fill
    values) are live from the start, as a loop holds what XLA's loop-invariant code motion
    took out of its body (:func:`hoisted`).
    """
    if isinstance(jaxpr, jcore.ClosedJaxpr):
        jaxpr = jaxpr.jaxpr
    flat = _Flat()
    given = list(input_names) + [None] * (len(jaxpr.invars) - len(input_names))
    env = {v: flat.new(v.aval, n) for v, n in zip(jaxpr.invars, given)}
    flat.add(jaxpr, env, "")
    nodes = flat.nodes
    outputs = {env[v] for v in jaxpr.outvars if not isinstance(v, jcore.Literal) and v in env}
    outputs |= {env[v] for v in kept if not isinstance(v, jcore.Literal) and v in env}
    skip = {env[v] for v in exclude if not isinstance(v, jcore.Literal) and v in env}
    counted_inputs = {env[v] for v in live_inputs}
    producer = {o: i for i, n in enumerate(nodes) for o in n.outs}
    readers: dict[int, list[int]] = {}
    for i, n in enumerate(nodes):
        for v in n.ins:
            readers.setdefault(v, []).append(i)
    end = len(nodes)
    primal = [producer[env[v]] for v in primal_outputs
              if not isinstance(v, jcore.Literal) and env.get(v) in producer]
    bwd = max(primal) + 1 if primal else next(
        (i for i, n in enumerate(nodes) if n.backward), end)
    invariant = hoisted(nodes, bwd, {env[v] for v in jaxpr.invars}) if hoist else set()
    material = {v for i, n in enumerate(nodes) for v in n.outs
                if not n.fusible or v in outputs
                or any(not nodes[j].fusible for j in readers.get(v, []))} | invariant
    # Where each materialised value is last read: a fused chain reads its anchors when the
    # materialising node at its end runs.
    last: dict[int, int] = {}
    anchors: dict[int, frozenset] = {}

    def anchors_of(v: int) -> frozenset:
        todo = [v]
        while todo:
            x = todo[-1]
            if x in anchors:
                todo.pop()
                continue
            p = producer.get(x)
            if x in material or p is None:
                anchors[x] = frozenset([x])
                todo.pop()
                continue
            pending = [y for y in nodes[p].ins if y not in anchors]
            if pending:
                todo.extend(pending)
                continue
            anchors[x] = frozenset().union(*(anchors[y] for y in nodes[p].ins))
            todo.pop()
        return anchors[v]

    for i, n in enumerate(nodes):
        if n.fusible and not any(o in material for o in n.outs):
            continue  # runs inside its consumer's fusion
        for v in n.ins:
            for a in anchors_of(v):
                last[a] = max(last.get(a, -1), i)
    beside = {v for n in nodes if n.matmul for v in (*n.ins, *n.outs)}
    # the saved activations the backward's matmuls read: first and last such read
    reads: dict[int, list[int]] = {}
    for i, n in enumerate(nodes[bwd:], bwd):
        for v in n.ins if n.matmul else ():
            if v in skip and flat.size[v]:
                reads.setdefault(v, []).append(i)
    starts, stops, shapes, items, kinds, names = [], [], [], [], [], []
    for v in sorted(material | counted_inputs):  # ids follow program order: traces align
        if v in skip and v not in invariant or not flat.size[v]:
            continue
        start = 0 if v in invariant else producer.get(v, 0)
        starts.append(start)
        stops.append(end - 1 if v in outputs else max(last.get(v, start), start,
                                                      bwd - 1 if v in invariant else 0))
        shapes.append(flat.shape[v])
        items.append(flat.size[v] // max(1, math.prod(flat.shape[v])))
        kinds.append(MATMUL if v in beside else 0)
        names.append(flat.names[v])
    for v, at in sorted(reads.items()):
        starts.append(min(at))
        stops.append(max(at))
        shapes.append(flat.shape[v])
        items.append(flat.size[v] // max(1, math.prod(flat.shape[v])))
        kinds.append(GATHERED)
        names.append(flat.names[v])
    return Timeline(tuple(starts), tuple(stops), tuple(shapes), tuple(items),
                    (None,) * len(shapes), rows, bwd, end, tuple(kinds), tuple(names))


def hoisted(nodes: list[_Node], forward_end: int, inputs: set[int]) -> set[int]:
    """Values no input feeds (iotas, broadcast constants: a causal mask, a fill value) that a
    node of the forward pass reading an input-fed value reads: what XLA's loop-invariant code
    motion materialises once before a loop whose body computes them (the GPU's layer loop:
    a causal attention's mask and its ``-inf`` fill at the scores' shape, docs/planner.md §7
    "Stop 35 (Sc3)")."""
    fed = set(inputs)
    for n in nodes:
        if any(v in fed for v in n.ins):
            fed.update(n.outs)
    return {v for n in nodes[:forward_end] if any(v in fed for v in n.ins)
            for v in n.ins if v not in fed}
