"""Named rematerialisation policies: what a layer's backward pass keeps versus recomputes.

One table for the model (which applies the policy with ``jax.checkpoint``) and the cost model
(which measures each policy's saved bytes and recompute FLOPs), so the two cannot disagree.
"""

from __future__ import annotations

from typing import Any

import jax

from jaxmp.config import REMAT_POLICY_NAMES

REMAT_POLICIES: dict[str, Any] = {
    "none": None,  # no jax.checkpoint at all: keep every residual
    # Keep the projections' outputs (matmuls without batch dims); recompute attention scores,
    # norms and activations, which are cheap in FLOPs but large in bytes.
    "save_dots": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
    "full": jax.checkpoint_policies.nothing_saveable,  # recompute the whole layer
}
assert tuple(REMAT_POLICIES) == REMAT_POLICY_NAMES  # the config's names (model.remat)


def checkpointed(fn: Any, remat: str, **kwargs: Any) -> Any:
    """``fn`` under the named policy (``fn`` itself for ``"none"``)."""
    if remat not in REMAT_POLICIES:
        raise ValueError(f"unknown remat policy {remat!r}; known: {', '.join(REMAT_POLICIES)}")
    if remat == "none":
        return fn
    return jax.checkpoint(fn, policy=REMAT_POLICIES[remat], **kwargs)
