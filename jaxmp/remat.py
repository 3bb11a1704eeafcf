"""Named rematerialisation policies: what a layer's backward pass keeps versus recomputes.

One table for the model (which applies the policy with ``jax.checkpoint``) and the cost model
(which measures each policy's saved bytes and recompute FLOPs), so the two cannot disagree.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import Any

import jax

from jaxmp.config import REMAT_POLICY_NAMES

# The names jaxmp's GPT gives its blocks' projection outputs (``jax.ad_checkpoint.checkpoint_name``)
# for name-based policies. A model without names (a research model of stock ``nnx.Linear``)
# gives a name-based policy nothing to save: it recomputes the whole layer, as ``"full"``.
QUERY, KEY, VALUE = "query", "key", "value"  # after their projections, before rotary embedding
ATTENTION_OUT = "attention_out"  # the output projection's
MLP_IN = "mlp_in"  # the MLP's wide input projections (up and, with SwiGLU, gate)
MLP_OUT = "mlp_out"  # the down projection's
PROJECTIONS = (QUERY, KEY, VALUE, ATTENTION_OUT, MLP_OUT)

REMAT_POLICIES: dict[str, Any] = {
    "none": None,  # no jax.checkpoint at all: keep every residual
    # Megatron's selective recomputation (Korthikanti et al. 2022): keep every residual but
    # the attention core's (XLA's S x S scores, probabilities and masks), which the backward
    # recomputes from the kept q, k, v (jaxmp.models.attention). Not a jax.checkpoint policy:
    # an outer policy decides for nested checkpoints too, so the core is recomputed by its own
    # VJP while :func:`checkpointed` traces the layer (:func:`recomputes_attention`). With
    # cuDNN's flash attention (it keeps no scores) and for attention jaxmp does not run (a
    # research model's own), it is "none".
    "selective": None,
    # Keep the projections' outputs (matmuls without batch dims); recompute attention scores,
    # norms and activations, which are cheap in FLOPs but large in bytes.
    # The row projections' outputs by name as well: as ring collective matmuls
    # (jaxmp.sharding.ring) they are sums of per-block products, not dots, and without their
    # names the policy kept every block's product and re-ran the ring's sends to add them up
    # again in the backward (Llama-3-70B's width, fsdp 8 x tensor 8: 7 more [rows, seq/t,
    # d_model] arrays per layer). Plainly partitioned they are dots: saved either way.
    "save_dots": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
        jax.checkpoint_policies.save_only_these_names(ATTENTION_OUT, MLP_OUT)),
    # MaxText's save_dot_except_mlpwi: keep the projections' outputs but the MLP's wide inputs
    # (4x-3.5x d_model, two of them with SwiGLU: most of save_dots' bytes), which are
    # recomputed with their activation, and attention, from the block's input and the kept q/k/v.
    "save_dots_except_mlp_in": jax.checkpoint_policies.save_only_these_names(*PROJECTIONS),
    "full": jax.checkpoint_policies.nothing_saveable,  # recompute the whole layer
}
assert tuple(REMAT_POLICIES) == REMAT_POLICY_NAMES  # the config's names (model.remat)

# What a pipeline's stash recomputes when the model runs without remat (its forward's residuals
# wait in a buffer, one slot per microbatch in flight, so they are chosen by a policy): casts,
# slices and reshapes, and elementwise ops. The stash keeps the matmuls' outputs, reductions,
# gathers and named values. Elementwise ops are what XLA's attention makes ``S x S`` float32
# arrays of (the scores minus their maximum, their exponent, the probabilities, the masks):
# kept, they were four float32 ``S x S`` arrays and two masks per block (gpt-1b stage 8 on 64
# H100s: 72.4 GiB compiled); recomputed from the scores, one.
STASH_RECOMPUTED = frozenset("""convert_element_type dynamic_slice slice sharding_constraint
reshape broadcast_in_dim transpose squeeze expand_dims copy copy_p select_n concatenate pad iota
add add_any sub mul div neg max min exp exp2 log log1p expm1 pow integer_pow square sqrt rsqrt
cbrt tanh logistic erf erfc erf_inv sin cos tan abs sign floor ceil round clamp rem
is_finite and or not xor eq ne lt le gt ge reduce_precision nextafter
""".split())


# The named scope a model's attention runs under (jaxmp.models.gpt): the cost model counts the
# memory traffic of XLA's attention (its S x S scores and probabilities) by it.
ATTENTION_SCOPE = "attention"


def stash_keeps(prim: Any, *_: Any, **__: Any) -> bool:
    """The ``jax.checkpoint`` policy of a pipeline's stash without remat (and of the cost
    model's staged residuals, so the planner measures what the stash keeps)."""
    return prim.name not in STASH_RECOMPUTED


def keeps_all_but_constraints(prim: Any, *_: Any, **__: Any) -> bool:
    """``"none"`` for a layer-scan body: every residual kept except sharding constraints'
    outputs, recomputed (free) from their inputs. A layer's param slice pinned to its sharding
    is otherwise saved as a residual, slice by slice, into a stacked copy of the layer weights
    beside the live stack (2 B/param with 16-bit params: 116 vs 90 MiB temporaries, test GPT
    on 8 deviceless H100s); recomputed, the backward re-slices the stack the scan forwards."""
    return prim.name != "sharding_constraint"


def keeps_layer(remat: str) -> bool:
    """Whether the policy re-runs none of the layer's matmuls in the backward pass ("none",
    "selective"): its weights are not needed again for a recomputation."""
    return REMAT_POLICIES.get(remat, 0) is None


_RECOMPUTE_ATTENTION = contextvars.ContextVar("jaxmp_recompute_attention", default=False)


def recomputes_attention() -> bool:
    """True while a layer is traced under ``"selective"``: XLA's attention core then keeps
    only its inputs for the backward pass."""
    return _RECOMPUTE_ATTENTION.get()


def _selective(fn: Callable, remat: str) -> Callable:
    """``fn``, traced with :func:`recomputes_attention` on under ``"selective"`` (as is else)."""
    if remat != "selective":
        return fn

    def traced(*args: Any, **kwargs: Any) -> Any:
        token = _RECOMPUTE_ATTENTION.set(True)
        try:
            return fn(*args, **kwargs)
        finally:
            _RECOMPUTE_ATTENTION.reset(token)

    return traced


def checkpointed(fn: Any, remat: str, *, scanned: bool = False, **kwargs: Any) -> Any:
    """``fn`` under the named policy (``"none"``: ``fn`` itself, or for a layer-scan body
    (``scanned``) :func:`keeps_all_but_constraints`; ``"selective"``: the same, its
    attention core recomputed)."""
    if remat not in REMAT_POLICIES:
        raise ValueError(f"unknown remat policy {remat!r}; known: {', '.join(REMAT_POLICIES)}")
    if keeps_layer(remat):
        fn = _selective(fn, remat)
        return jax.checkpoint(fn, policy=keeps_all_but_constraints, **kwargs) if scanned else fn
    return jax.checkpoint(fn, policy=REMAT_POLICIES[remat], **kwargs)


def stashed(fn: Any, remat: str, **kwargs: Any) -> Any:
    """``fn`` as a pipeline's stash runs a block (jaxmp.pipeline.chunk, and the cost model's
    staged residuals): under :func:`stash_keeps` (``kwargs`` to its checkpoint) where the
    policy keeps the layer ("none", "selective": its attention core recomputed too), else
    :func:`checkpointed`."""
    if keeps_layer(remat):
        return jax.checkpoint(_selective(fn, remat), policy=stash_keeps, **kwargs)
    return checkpointed(fn, remat)
