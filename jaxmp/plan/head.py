"""The head's output gradient, held through the stack's backward on GPUs.

XLA's GPU compiler writes the loss gradient over the logits in place and takes the head's
weight gradient only after the layers' backward (the scheduler puts what nothing downstream
waits for last), so a logits-sized array stays live through every block's backward pass.
Measured in the heap simulator's trace (docs/planner.md §7 "Stop 32"): gpt-1b, 2 layers,
float32, fsdp 8 on deviceless H100s holds 3.07 GiB (rows 8 x seq 2048 x vocab 50304 x 4 B)
from the head's backward to its weight-gradient matmul after the last block's. It does not
grow with depth, so shallow models show it (a quarter of their peak) and deep ones hide it.
"""

from __future__ import annotations

import math

import numpy as np

from jaxmp.cost.model import LayerCost
from jaxmp.plan.context import Context


def largest_value(lay: LayerCost, rows: float, divisor, upcast_16bit: bool) -> float:
    """The largest batch-sized value ``lay`` keeps for its backward at ``rows`` (a head's:
    its logits, whose gradient has their shape), each divided by ``divisor``, in the layer's
    activation dtype: the gradient is the logits' dtype even where the loss keeps a float32
    copy (bf16 gpt-1b: 1.54 GiB held, not 3.07)."""
    saved = lay.saved.get("none")
    if saved is None:
        return 0.0
    item = 4 if upcast_16bit and lay.act_itemsize == 2 else lay.act_itemsize
    return max((math.prod(shape) * item / divisor(shape, bdim) * rows / saved.rows
                for shape, bdim in zip(saved.shapes, saved.batch_dims) if bdim is not None),
               default=0.0)


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
    below[:post] = ctx.cached(("head", rows, fsdp, tensor, sp), lambda: largest_value(
        ctx.cost.layers[post], rows, ctx.divisor(post, fsdp, tensor, sp),
        ctx.profile.upcasts_16bit))
    return below
