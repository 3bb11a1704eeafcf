"""One layer traced alone: its FLOPs, what its backward pass keeps, and what it needs.

The layer's recorded call (:mod:`jaxmp.cost.trace`) is re-run as ``f(params, rest, *inputs)``
and differentiated under each remat policy. From that one program per policy come the forward
and backward FLOPs (backward equations are the transposed ones), the VJP residuals (what a
scan stores), the residuals an optimising compiler keeps (:mod:`jaxmp.cost.fusion`) and the
backward pass's peak extra memory (:mod:`jaxmp.cost.liveness`). Tracing again with one batch
row tells which dims of each array grow with the batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
# private, but the one tracer-level dead-code pass (it follows pjit and custom rules inside)
from jax._src.interpreters.partial_eval import dce_jaxpr

from jaxmp.cost import flops as F
from jaxmp.cost.fusion import kept_values
from jaxmp.cost.liveness import Timeline, backward_timeline
from jaxmp.cost.splits import Names, var_names
from jaxmp.cost.trace import LayerCall
from jaxmp.sharding.tree import unbox
from jaxmp.cost.traffic import count as count_traffic
from jaxmp.cost.traffic import linear
from jaxmp.remat import checkpointed, keeps_layer, stashed

@dataclass(frozen=True)
class Saved:
    """Arrays a layer's backward pass keeps (VJP residuals other than parameters)."""

    shapes: tuple[tuple[int, ...], ...]
    itemsizes: tuple[int, ...]
    batch_dims: tuple[int | None, ...]  # the dim that grows with the batch; None: constant
    rows: int  # batch rows the shapes were traced at
    names: tuple = ()  # per array, its dims' parameter names (cost.splits); (): not traced

    @property
    def bytes(self) -> float:
        return float(sum(math.prod(s) * i for s, i in zip(self.shapes, self.itemsizes)))

    def bytes_at(self, rows: float, divisor: Callable[[tuple, int | None], int] | None = None,
                 ) -> float:
        """Bytes at ``rows`` batch rows, each array divided by ``divisor(shape, batch_dim)``."""
        const, per_row = self.split(divisor)
        return const + per_row * rows

    def split(self, divisor: Callable[[tuple, int | None], int] | None = None,
              upcast_16bit: bool = False) -> tuple[float, float]:
        """``(constant bytes, bytes per batch row)``, each array divided by ``divisor``;
        ``upcast_16bit`` counts 16-bit arrays as float32 (see DeviceProfile)."""
        const = per_row = 0.0
        for k, (shape, item, bdim) in enumerate(zip(self.shapes, self.itemsizes,
                                                    self.batch_dims)):
            item = 4 if upcast_16bit and item == 2 else item
            b = math.prod(shape) * item / (divisor(shape, bdim, self.names_of(k))
                                           if divisor else 1)
            if bdim is None:
                const += b
            else:
                per_row += b / self.rows
        return const, per_row

    def names_of(self, k: int) -> tuple | None:
        """Array ``k``'s per-dim parameter names (None: not traced)."""
        return self.names[k] if self.names else None


def with_rows(tree: Any, rows: int, new: int) -> Any:
    """The same abstract arrays with the batch dim (size ``rows``, leading first) set to ``new``."""

    def one(x: Any) -> Any:
        if not isinstance(x, jax.ShapeDtypeStruct) or rows not in x.shape:
            return x
        shape = list(x.shape)
        shape[shape.index(rows)] = new
        return jax.ShapeDtypeStruct(tuple(shape), x.dtype)

    return jax.tree.map(one, tree)


def saved_from(avals: Sequence[Any], avals_one_row: Sequence[Any] | None, rows: int,
               names: Sequence[Names] = ()) -> Saved:
    shapes = tuple(tuple(int(d) for d in a.shape) for a in avals)
    if avals_one_row is not None and len(avals_one_row) == len(avals):
        bdims = tuple(next((i for i, (x, y) in enumerate(zip(a.shape, b.shape)) if x != y), None)
                      for a, b in zip(avals, avals_one_row))
    else:  # structure changed with the batch: fall back to "a dim equal to rows"
        bdims = tuple(s.index(rows) if rows in s else None for s in shapes)
    return Saved(shapes, tuple(a.dtype.itemsize for a in avals), bdims, rows, tuple(names))


def _layer_fn(call: LayerCall) -> tuple[Callable, list, list[bool]]:
    """``f(params, rest, *arrays)`` re-running the recorded call; which arrays are float."""
    leaves, treedef = jax.tree.flatten((call.args, call.kwargs))
    dyn = [i for i, x in enumerate(leaves) if isinstance(x, jax.ShapeDtypeStruct)]

    def f(params: Any, rest: Any, *arrays: Any) -> Any:
        full = list(leaves)
        for i, a in zip(dyn, arrays):
            full[i] = a
        args, kwargs = jax.tree.unflatten(treedef, full)
        return nnx.merge(call.graphdef, params, rest)(*args, **kwargs)

    arrays = [leaves[i] for i in dyn]
    return f, arrays, [bool(jnp.issubdtype(a.dtype, jnp.inexact)) for a in arrays]


def carried_input_bytes(call: LayerCall) -> float:
    """Bytes of the float inputs whose tangent reaches the layer's outputs: the activation
    stream a tensor-parallel block all-reduces (its gradient, backward). A causal mask made
    from the tokens enters only through comparisons and carries none, however large."""
    f, arrays, is_float = _layer_fn(call)
    floats = [a for a, fl in zip(arrays, is_float) if fl]
    if not floats:
        return 0.0

    def tangent_out(params: Any, rest: Any, values: list, tangents: list) -> Any:
        def g(*fl: Any) -> Any:
            it = iter(fl)
            return f(params, rest, *[next(it) if flt else a for a, flt in zip(values, is_float)])
        primals = [a for a, flt in zip(values, is_float) if flt]
        return jax.jvp(g, tuple(primals), tuple(tangents))[1]

    closed = jax.make_jaxpr(tangent_out)(call.params, call.rest, arrays, floats)
    _, used = dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars))
    return float(sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize
                     for a, u in zip(floats, used[-len(floats):]) if u))


def _vjp_program(call: LayerCall, policy: str, staged: bool = False
                 ) -> tuple[Callable, list[bool]]:
    """``run(params, rest, cts, *arrays) -> (out, grads, residuals)``: forward + backward under
    ``policy`` (``staged``: under a pipeline stash's policy, "none" or "selective"). Cotangents
    are inputs, not constants, so XLA cannot fold the backward away."""
    f, _, is_float = _layer_fn(call)
    f = stashed(f, policy) if staged else checkpointed(f, policy)
    keep: list[bool] = []

    def run(params: Any, rest: Any, cts: list, *arrays: Any) -> Any:
        floats = [a for a, fl in zip(arrays, is_float) if fl]

        def g(p: Any, *fl: Any) -> Any:
            it = iter(fl)
            return f(p, rest, *[next(it) if flt else a for a, flt in zip(arrays, is_float)])

        out, vjp = jax.vjp(g, params, *floats)
        residuals = jax.tree.leaves(vjp)
        param_ids = {id(x) for x in jax.tree.leaves(params)}
        keep[:] = [id(r) not in param_ids for r in residuals]
        it = iter(cts)
        full = jax.tree.map(lambda o: next(it) if jnp.issubdtype(o.dtype, jnp.inexact)
                            else np.zeros(o.shape, jax.dtypes.float0), out)
        return out, vjp(full), residuals

    return run, keep


def _outputs(call: LayerCall, arrays: list) -> list:
    """The abstract output leaves of the layer at ``arrays`` (traced once per batch size:
    every policy's program shares them)."""
    return jax.tree.leaves(jax.eval_shape(_layer_fn(call)[0], call.params, call.rest, *arrays))


def _cotangents(outputs: list) -> list:
    return [x for x in outputs if jnp.issubdtype(x.dtype, jnp.inexact)]


STACK_NAME = "layers"  # a stacked parameter's layer dim (DESIGN.md: logical names)


def _input_dependent(jaxpr: Any) -> set:
    """The variables computed from the program's inputs. The rest (a causal mask and the fill
    beside it, built from iotas and literals) a scan's partial evaluation hoists out of the
    loop as invariants: not stacked per layer (the research LM at tensor 8: 2.5 MB a layer
    that XLA:CPU never stores, docs/planner.md §7 "Stop 35 (Rm3)")."""
    out = set(jaxpr.invars)
    for eqn in jaxpr.eqns:
        if any(not isinstance(v, jax.extend.core.Literal) and v in out for v in eqn.invars):
            out.update(eqn.outvars)
    return out


def _names_of(names: dict, v: Any) -> Names | None:
    return None if isinstance(v, jax.extend.core.Literal) else names.get(v)


def input_names(call: LayerCall, n_inputs: int) -> list[Names | None]:
    """The names of a layer program's inputs: its parameters' logical names per dim (the
    state's other variables, the cotangents and the activations: whole)."""
    params = []
    for x in jax.tree.leaves(call.params, is_leaf=lambda x: isinstance(x, nnx.Variable)):
        value, names, _ = unbox(x)
        rank = len(np.shape(value))
        if names is not None and len(names) > rank:  # one block of a stack: no "layers" dim
            names = tuple(n for n in names if n != STACK_NAME)
        params.append(tuple(frozenset([n]) if n else frozenset() for n in names)
                      if names is not None and len(names) == rank else None)
    return params + [None] * (n_inputs - len(params))


def _residual_avals(call: LayerCall, policy: str, arrays: list, rows: int, staged: bool = False,
                    outputs: list | None = None
                    ) -> tuple[Any, list, list, Timeline | None, Timeline | None, list, list]:
    """The traced program, the residuals it keeps, those that survive fusion, the peak
    bytes its backward pass needs beyond them (see :mod:`jaxmp.cost.liveness`), its forward
    pass as a loop body runs it (the fused residuals live to its end, where they are copied
    into their stacks; the loop-invariant values hoisted before it), and the residuals' and
    survivors' per-dim parameter names (:mod:`jaxmp.cost.splits`);
    ``outputs``: the layer's :func:`_outputs` at ``arrays``, if known. ``staged`` (what a
    pipeline's stash keeps): no timelines, which only a layer loop's model reads."""
    run, keep = _vjp_program(call, policy, staged)
    outputs = _outputs(call, arrays) if outputs is None else outputs
    cts = _cotangents(outputs)
    with jax.disable_jit():  # inline jitted helpers: a flat program for the analyses
        jaxpr = jax.make_jaxpr(run)(call.params, call.rest, cts, *arrays)
    outvars, invars = jaxpr.jaxpr.outvars, jaxpr.jaxpr.invars
    varying = _input_dependent(jaxpr.jaxpr)  # (a pipeline's stash is no scan: keeps them all)
    residuals = [v for v, k in zip(outvars[len(outvars) - len(keep):], keep)
                 if k and (staged or isinstance(v, jax.extend.core.Literal) or v in varying)]
    names_in = input_names(call, len(invars))
    names = var_names(jaxpr, names_in)
    res_names = [_names_of(names, v) for v in residuals]
    if staged:
        return jaxpr, [v.aval for v in residuals], [], None, None, res_names, []
    n_state = len(jax.tree.leaves((call.params, call.rest)))
    n_out = len(outputs)
    n_pgrad = len(jax.tree.leaves(call.params))
    producers = {v: i for i, e in enumerate(jaxpr.jaxpr.eqns) for v in e.outvars}
    forward_end = 1 + max((producers[v] for v in outvars[:n_out]
                           if not isinstance(v, jax.extend.core.Literal) and v in producers),
                          default=-1)
    fused = kept_values(jaxpr, residuals, exclude=invars[:n_state], forward_end=forward_end)
    # the invariant residuals are no layer's saved activations: one copy, live in its backward
    accounted = list(outvars[:n_out + n_pgrad]) + residuals
    transient = backward_timeline(jaxpr, exclude=accounted,
                                  live_inputs=invars[n_state:n_state + len(cts)],
                                  primal_outputs=outvars[:n_out], rows=rows,
                                  input_names=names_in)
    # The forward body: every residual output is stored into its stack (or, an invariant,
    # hoisted: ``hoist``), not held to the body's end, but the fused ones it computes
    anchors = {id(v) for v in fused}
    stored = list(outvars[:n_out + n_pgrad]) + list(outvars[len(outvars) - len(keep):])
    forward = backward_timeline(jaxpr, exclude=[v for v in stored if id(v) not in anchors],
                                primal_outputs=outvars[:n_out], rows=rows, kept=fused,
                                hoist=True, input_names=names_in)
    return (jaxpr, [v.aval for v in residuals], [v.aval for v in fused], transient, forward,
            res_names, [_names_of(names, v) for v in fused])


def analyse_layer(call: LayerCall, rows: int, policies: Sequence[str]) -> dict[str, Any]:
    _, arrays, _ = _layer_fn(call)
    one_row = with_rows(arrays, rows, 1) if rows > 1 else arrays
    outputs, outputs_one = _outputs(call, arrays), _outputs(call, one_row) if rows > 1 else None
    out: dict[str, Any] = {"saved": {}, "fused": {}, "recompute": {}, "transient": {},
                          "forward": {}, "skipped": {}, "traffic": {}}
    n_state = len(jax.tree.leaves((call.params, call.rest)))
    totals: dict[str, float] = {}
    for policy in policies:
        jaxpr, res_avals, fused, transient, forward, res_names, fused_names = _residual_avals(
            call, policy, arrays, rows, outputs=outputs)
        traffic = count_traffic(jaxpr, jaxpr.jaxpr.invars[:n_state])
        if rows > 1:
            one, res_one, fused_one, transient_one, forward_one = _residual_avals(
                call, policy, one_row, 1, outputs=outputs_one)[:5]
            traffic_one = count_traffic(one, one.jaxpr.invars[:n_state])
        else:
            res_one = fused_one = traffic_one = None
            transient_one, forward_one = transient, forward
        out["traffic"][policy] = linear(traffic, traffic_one, rows)
        out["saved"][policy] = saved_from(res_avals, res_one, rows, res_names)
        out["fused"][policy] = saved_from(fused, fused_one, rows, fused_names)
        out["transient"][policy] = transient.with_batch_dims(
            transient_one if rows > 1 else None)
        out["forward"][policy] = forward.with_batch_dims(forward_one if rows > 1 else None)
        fwd, bwd = F.Counts(), F.Counts()
        for leaf in F.iter_eqns(jaxpr):
            (bwd if F.is_backward(leaf.name_stack) else fwd).__iadd__(
                leaf.counts.scaled(leaf.multiplier))
        totals[policy] = fwd.flops + bwd.flops
        out["skipped"][policy] = fwd.skipped + bwd.skipped
        if policy == "none":
            out["fwd"], out["bwd"] = fwd.flops, bwd.flops
            out["transcendentals"] = fwd.transcendentals + bwd.transcendentals
    for policy in policies:
        out["recompute"][policy] = max(0.0, totals[policy] - totals.get("none", totals[policy]))
    out["staged"] = {}
    for policy in (p for p in policies if keeps_layer(p)):  # what a pipeline's stash keeps
        staged = _residual_avals(call, policy, arrays, rows, staged=True, outputs=outputs)
        one = _residual_avals(call, policy, one_row, 1, staged=True,
                              outputs=outputs_one)[1] if rows > 1 else None
        out["staged"][policy] = saved_from(staged[1], one, rows, staged[5])
    out["probe"] = (_layer_fn(call)[0], _vjp_program(call, "none")[0],
                    (call.params, call.rest, _cotangents(outputs), *arrays))
    return out


def _xla_flops(fn: Callable, args: tuple) -> float:
    ca = jax.jit(fn).lower(*args).compile().cost_analysis()
    ca = ca[0] if isinstance(ca, (list, tuple)) else ca
    return float(ca.get("flops", float("nan")))


def xla_layer_check(cost: Any) -> list[dict[str, Any]]:
    """Each distinct layer compiled alone: our forward and forward+backward FLOPs vs XLA's.

    Both sides exclude transcendental ops (XLA reports them separately). Compiling is what makes
    this a check rather than a second estimate, so it is slow for large layers.
    """
    rows = []
    by_name = {lay.name.rsplit("/", 1)[0] if lay.kind == "block" else lay.name: lay
               for lay in cost.layers}
    for name, (fwd_fn, train_fn, args) in cost.probes.items():
        lay = by_name[name]
        fwd_args = args[:2] + args[3:]  # no cotangents
        for what, fn, a, ours in (("fwd", fwd_fn, fwd_args, lay.fwd_flops),
                                  ("fwd+bwd", train_fn, args, lay.fwd_flops + lay.bwd_flops)):
            xla = _xla_flops(fn, a)
            rows.append({"layer": name, "pass": what, "predicted": ours, "xla": xla,
                         "rel_err": abs(ours - xla) / xla if xla else float("nan")})
    return rows
