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
    below = np.zeros(len(ctx.kinds))
    if not ctx.profile.holds_head_gradient or "post" not in ctx.kinds:
        return below
    post = int(np.flatnonzero(ctx.kinds == "post")[0])
    rows = ctx.cost.rows / (data * fsdp * microbatches)
    below[:post] = ctx.head_gradient(post, rows, fsdp, tensor, sp)
    return below


def deferred_head_grads(ctx: Context, grads: np.ndarray, held: np.ndarray) -> np.ndarray:
    """Per layer: the head's weight-gradient bytes (of ``grads``, a layer table's) that are
    not yet made during that layer's backward: where ``held`` (:func:`held_below_head`) holds
    the output gradient in their place."""
    post = ctx.kinds == "post"
    return np.where(held > 0, grads[post].sum(), 0.0)
