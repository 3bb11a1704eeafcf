"""The head's output gradient, held through the stack's backward on GPUs.

XLA's GPU compiler writes the loss gradient over the logits in place and takes the head's
weight gradient only after the layers' backward (the scheduler puts what nothing downstream
waits for last), so a logits-sized array stays live through every block's backward pass.
Measured in the heap simulator's trace (docs/planner.md §7 "Stop 32"): gpt-1b, 2 layers,
float32, fsdp 8 on deviceless H100s holds 3.07 GiB (rows 8 x seq 2048 x vocab 50304 x 4 B)
from the head's backward to its weight-gradient matmul after the last block's. It does not
grow with depth, so shallow models show it (a quarter of their peak) and deep ones hide it.
The head's weight gradient, made after the stack's backward, is not live during it.
"""

from __future__ import annotations

import numpy as np

from jaxmp.plan.context import Context


def held_below_head(ctx: Context, data: int, fsdp: int, tensor: int, microbatches: int,
                    sp: bool = False) -> np.ndarray:
    """Per layer: the bytes of the head's output gradient live during that layer's backward
    (every layer below the head) where the profile holds it (GPUs); zeros elsewhere."""
    kinds = [lay.kind for lay in ctx.cost.layers]
    below = np.zeros(len(kinds))
    if not ctx.profile.holds_head_gradient or "post" not in kinds:
        return below
    post = kinds.index("post")
    rows = ctx.cost.rows / (data * fsdp * microbatches)
    # once per mesh and microbatch count: predict runs for every candidate layout
    below[:post] = ctx.cached(("head", rows, fsdp, tensor, sp), lambda: ctx.cost.layers[
        post].largest_value(rows, ctx.divisor(post, fsdp, tensor, sp),
                            ctx.profile.upcasts_16bit))
    return below


def deferred_head_grads(ctx: Context, grads: np.ndarray, held: np.ndarray) -> np.ndarray:
    """Per layer: the head's weight-gradient bytes (of ``grads``, a layer table's) that are
    not yet made during that layer's backward: where ``held`` (:func:`held_below_head`) holds
    the output gradient in their place."""
    kinds = [lay.kind for lay in ctx.cost.layers]
    if "post" not in kinds:
        return np.zeros(len(kinds))
    return np.where(held > 0, grads[kinds.index("post")], 0.0)
