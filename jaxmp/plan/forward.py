"""The forward pass of a scanned layer stack on GPUs: the stacks whole, one body beside them.

XLA allocates a layer loop's residual stacks whole before the loop (every layer's slot), so
while the forward runs layer k the device holds all of them, and beside them the body's own
values: each residual is computed into a buffer of its own and copied into its stack slot at
the body's end, and loop-invariant values the body reads (a causal attention's mask and its
fill value at the scores' shape) were hoisted out of the loop and are materialised for all
of it. With XLA attention that is more than the backward's working set (the layer's float32
scores, their exponentials and the 16-bit probabilities, the mask and the fill, against the
backward's score-sized values), so the forward can be the step's peak: gpt-1b's shape at 4
layers, seq 2048, fsdp 8 on H200s, bfloat16 XLA attention (docs/planner.md §7 "Stop 35").

:attr:`LayerCost.forward <jaxmp.cost.model.LayerCost>` is that body as a
:class:`~jaxmp.cost.liveness.Timeline`; this module sizes it on a layout. Only where the
profile stores the fused residuals in a scan (:func:`jaxmp.plan.scan.stores_fused`);
elsewhere the backward is the peak the model knows.
"""

from __future__ import annotations

import numpy as np

from jaxmp.plan.context import Context
from jaxmp.plan.scan import stores_fused


def forward_work(ctx: Context, remat: str, fsdp: int, tensor: int, rows: float,
                 sp: bool = False) -> np.ndarray:
    """Per layer, the bytes its forward body holds beside the stacks at ``rows`` rows per
    device (0 outside a loop, or where the profile does not model it): the body's live
    values (its gathered weights among them), and under fsdp the next layer's weights
    (the double-buffered body prefetches them) and the layers' after the stack (the
    scheduler issues the backward's first gather, the head's weights with it, before the
    loop: nothing in the loop feeds it)."""
    out = np.zeros(len(ctx.cost.layers))
    layers = ctx.cost.layers
    stack = [i for i in ctx.first if stores_fused(ctx.profile, layers[i], remat,
                                                   ctx.cost.seq_len) and layers[i].forward]
    if not stack:
        return out
    after = max(np.flatnonzero(ctx.in_loop)) + 1
    head = sum(ctx.shard(j, fsdp, tensor).gather_wire for j in range(after, len(layers))
               if not ctx.tied[j]) if fsdp > 1 else 0.0
    for i in stack:
        body = layers[i].forward[remat]
        sizes = ctx.cached(("forward", i, remat, fsdp, tensor, sp), lambda: body.sizes(
            ctx.divisor(i, fsdp, tensor, sp), ctx.profile.upcasts_16bit))
        ahead = ctx.shard(i, fsdp, tensor).gather_wire + head if fsdp > 1 else 0.0
        out[ctx.group_of == ctx.group_of[i]] = body.peak_of(sizes, rows, forward=True) + ahead
    return out
