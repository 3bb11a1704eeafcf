"""Custom VJPs that change what a backward pass keeps or when it runs, with the same
gradients: the block's elementwise functions recompute their intermediates from their inputs
(:func:`recomputed`), and the output head hands on its input gradient only after its weight
gradient (:func:`weight_grad_first`). Each says why, with the memory it measured.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxmp.sharding import constrain


def recomputed(fn: Callable[..., jax.Array], *static: Any) -> Callable[..., jax.Array]:
    """``fn(*arrays, *static)`` whose backward pass recomputes it from its inputs: it keeps its
    array inputs and nothing it computes from them, and differentiates ``fn`` as JAX would.

    Why: a scanned layer's body runs under a remat policy that keeps every residual
    (:func:`jaxmp.remat.keeps_all_but_constraints`), so an elementwise function's VJP
    intermediates are stored per layer: each norm's float32 copy of the residual stream and its
    float32 normed value, and GELU's four tanh-form intermediates beyond its input and output
    (Nemotron-4 15B at tensor 4, micro-batch 4: 1.71 -> 0.68 GiB saved per layer,
    docs/planner.md §6). A nested ``jax.checkpoint`` does not help there: the outer policy
    decides its residuals too. A custom VJP's residuals are what its forward returns."""
    @jax.custom_vjp
    def f(*arrays: jax.Array) -> jax.Array:
        return fn(*arrays, *static)

    def forward(*arrays: jax.Array) -> tuple[jax.Array, tuple]:
        return fn(*arrays, *static), arrays

    def backward(arrays: tuple, grad: jax.Array) -> tuple:
        return jax.vjp(lambda *a: fn(*a, *static), *arrays)[1](grad)

    f.defvjp(forward, backward)
    return f


def weight_grad_first(x: jax.Array, w: jax.Array, w_names: Any = None) -> jax.Array:
    """``x @ w`` whose backward pass hands on the input gradient only once the weight
    gradient is computed (an ``optimization_barrier`` over the input gradient and the weight
    gradient); the same gradients.

    Why: the output head under sequence parallelism. Its weight gradient reads the final
    norm's output gathered whole again (``[batch, seq, embed]``) and the logits' gradient
    (``[batch, seq, vocab / tensor]``); nothing else needs it, so XLA's GPU scheduler ran it
    after the layers' backward pass and kept both alive through it (gpt-1b at 4 layers,
    tensor 8, 4 microbatches: 11.44 -> 9.45 GiB compiled, docs/planner.md §7 "Stop 29").
    Tying the two gradients ends both buffers where the head's backward ends, as without
    sequence parallelism (where the GPT does not use it). The weight gradient enters the
    barrier in ``w_names``' sharding (the stored weight's logical names): the partitioner
    cannot reduce-scatter across a barrier, so without it the fsdp partial sums were
    all-reduced whole (twice a reduce-scatter's bytes; docs/planner.md §7 "Stop 33")."""

    @jax.custom_vjp
    def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
        return x @ w

    def forward(x: jax.Array, w: jax.Array) -> tuple[jax.Array, tuple]:
        return x @ w, (x, w)

    def backward(res: tuple, grad: jax.Array) -> tuple:
        dx, dw = jax.vjp(jnp.matmul, *res)[1](grad)
        if w_names is not None:
            dw = constrain(dw, w_names)
        return jax.lax.optimization_barrier((dx, dw))

    matmul.defvjp(forward, backward)
    return matmul(x, w)
