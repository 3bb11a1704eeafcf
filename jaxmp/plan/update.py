"""The optimizer update's temporaries per device — the one definition the plain and the
pipelined predictions (:mod:`jaxmp.plan.predict`, :mod:`jaxmp.plan.pipeline`) both charge:
master weights, optimizer state over data, in-place GPU updates, the accumulator's width."""

from __future__ import annotations

from jaxmp.plan.context import Context
from jaxmp.plan.layout import Layout
from jaxmp.plan.master import MasterTerms, accumulator_width


def update_terms(ctx: Context, m: MasterTerms, params: float, layout: Layout, zero: int,
                 accumulates: bool, layer_grads: float = float("inf")) -> tuple[float, float]:
    """``(accumulator, update)``: what the gradient reduction and the optimizer hold per device
    — beside every backward pass, and after the last one.

    Beside the backward: accumulating (microbatches, or a pipeline's chunks: ``accumulates``),
    the float32 running sum
    (:mod:`jaxmp.gradsum`: float32 with or without a master,
    :func:`~jaxmp.plan.master.accumulator_width`); and XLA's data-axis reduction of the
    gradients (no reducer) writes a reduced copy beside the device's own: the all-reduce's
    whole, the reduce-scatter's data slice with the optimizer state sharded over data (once
    after the microbatches: that copy is made after the backward). It reduces one backward's
    gradients in the params' width (16-bit with a master: the GPU
    compiler's wire; XLA:CPU widens 16-bit collectives to float32) or the float32 sum. One
    backward's all-reduce over data (the optimizer replicated) runs layer by layer where the
    backend updates in place: each layer's reduced copy replaces its gradients (a stack's
    gradient buffer is written with the reduced values), so beside them the reduction holds
    two layers' in flight (the double-buffered layer loop runs two layers' all-reduces per
    iteration) — ``layer_grads``: the largest layer's gradients as the backward holds them
    (GPU-compiled, docs/planner.md §7 "Stop 31").

    After the backward, where the backend updates the donated state in place
    (``DeviceProfile.updates_in_place``, the GPU compiler): the gradients and the reduction's
    buffers (its slice, its whole after microbatches, or the last layers' in flight); then,
    with the state sharded over data and no master, the updated slice and the params gathered
    from it (a master's 16-bit copy is cast and gathered in the next step's forward, charged
    there). XLA:CPU computes the new state beside the old: the
    float32 gradients and the update (its data slice) beside the reduction's buffers, and a
    master's 16-bit params."""
    data = layout.sizes["data"]
    summed = params * ctx.cached(("accumulator_width",), lambda: accumulator_width(ctx.cost)) \
        if accumulates else 0.0
    grads = summed or params
    wire = m.wide if m.copy and not summed and ctx.profile.upcasts_16bit else 1.0
    reduced = grads * wire / zero if data > 1 else 0.0
    if ctx.profile.updates_in_place and not summed and zero == 1 \
            and not layout.reduce_after_microbatches:
        reduced = min(reduced, 2 * layer_grads * wire)
    accumulator = summed + (0.0 if layout.reduce_after_microbatches else reduced)
    if ctx.profile.updates_in_place:
        gathered = params * (1 + 1 / zero) if zero > 1 and not m.copy else 0.0
        return accumulator, max(grads + reduced, reduced + gathered)
    if m.copy:  # the 16-bit gradients (or the float32 sum), the float32 update on the
        # master's slice, and the 16-bit params
        return accumulator, (0.0 if summed else params) + accumulator \
            + 2 * params * m.wide / zero + m.copy
    return accumulator, (params + params / zero) * m.wide + accumulator
