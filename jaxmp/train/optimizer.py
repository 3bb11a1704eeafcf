"""The optimizer, built straight from the ``[optimizer]`` config section.

AdamW with a linear warmup then cosine decay to ``lr * min_lr_ratio``, global-norm clipping, and
no weight decay on vectors (norm scales, biases) — the usual recipe for transformers, from Optax.
"""

from __future__ import annotations

from typing import Any

import jax
import optax

from jaxmp.config import OptimizerConfig


def make_schedule(opt: OptimizerConfig, total_steps: int) -> optax.Schedule:
    """Linear warmup to ``lr`` then cosine decay to ``lr * min_lr_ratio`` at ``total_steps``."""
    warmup = min(opt.warmup_steps, max(total_steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=opt.lr, warmup_steps=warmup,
        decay_steps=max(total_steps, warmup + 1), end_value=opt.lr * opt.min_lr_ratio)


def make_optimizer(opt: OptimizerConfig, total_steps: int) -> optax.GradientTransformation:
    """AdamW with global-norm clipping (``clip_norm`` 0: off); decay only on matrices."""
    schedule = make_schedule(opt, total_steps)

    def decay_mask(params: Any) -> Any:
        return jax.tree.map(lambda p: p.ndim >= 2, params)

    chain = [optax.clip_by_global_norm(opt.clip_norm)] if opt.clip_norm > 0 else []
    chain.append(optax.adamw(schedule, b1=opt.beta1, b2=opt.beta2, eps=opt.eps,
                             weight_decay=opt.weight_decay, mask=decay_mask))
    return optax.chain(*chain)
