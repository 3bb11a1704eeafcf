"""Microbatch gradients added into their float32 running sum inside the backward pass.

Accumulating k microbatches with ``lax.scan`` the plain way holds, beside the float32 running
sum, one microbatch's whole gradient (bfloat16 with 16-bit params: 2 bytes per parameter) until
the scan's body adds it. Megatron adds each parameter's gradient into its float32 "main grad"
as the backward produces it, so that copy never exists whole. This module does the same for a
stack of layers run by :func:`scan_layers` (the GPT's blocks):

* the step passes a float32 *token* per parameter into the loss (:func:`summing_into`, keyed by
  the parameter's traced value) and asks for the loss's vector-Jacobian product with the running
  sum as the token's cotangent;
* :func:`scan_layers` carries each stacked parameter's token through the layer scan; :func:`_tap`
  hands the layer its slice unchanged, and its backward adds the slice's gradient (cast to
  float32) into the carried cotangent at the layer's index — a dynamic-update-slice of the
  backward loop's carry, done in place, so the only parameter-sized gradient buffer of the
  stack is the float32 sum itself.

Outside :func:`summing_into` (or for parameters it does not list) :func:`scan_layers` is a plain
``lax.scan``.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp

_SUMS: ContextVar[tuple[dict[int, Any], dict[int, Any]] | None] = ContextVar("sums",
                                                                               default=None)


@jax.custom_vjp
def _tap(token: jax.Array, layer: jax.Array, i: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Identity on ``(token, layer)``; the backward adds ``layer``'s cotangent into the token's
    at index ``i`` (and gives the layer none: its gradient lives in the sum)."""
    return token, layer


def _tap_fwd(token: jax.Array, layer: jax.Array, i: jax.Array) -> tuple:
    return (token, layer), i


def _tap_bwd(i: jax.Array, cts: tuple) -> tuple:
    ct_token, g = cts
    row = jax.lax.dynamic_index_in_dim(ct_token, i, 0, keepdims=False)
    summed = jax.lax.dynamic_update_index_in_dim(ct_token, row + g.astype(ct_token.dtype), i, 0)
    return summed, None, None


_tap.defvjp(_tap_fwd, _tap_bwd)


@contextlib.contextmanager
def summing_into(tokens: dict[int, Any]) -> Iterator[dict[int, Any]]:
    """While tracing inside, :func:`scan_layers` carries ``tokens[id(stacked leaf)]`` through
    its scan; the yielded dict maps the same ids to the carried tokens after the scan (the
    outputs whose cotangent the caller sets to the running sum)."""
    out: dict[int, Any] = {}
    handle = _SUMS.set((tokens, out))
    try:
        yield out
    finally:
        _SUMS.reset(handle)


def scan_layers(body: Callable[[Any, Any], tuple[Any, Any]], x: Any, stacked: Any) -> Any:
    """``lax.scan(body, x, stacked)``'s final carry; under :func:`summing_into`, the listed
    stacked leaves' gradients are added into their running sums inside the backward."""
    context = _SUMS.get()
    leaves, treedef = jax.tree.flatten(stacked)
    tapped = [] if context is None else [k for k, a in enumerate(leaves) if id(a) in context[0]]
    if not tapped:
        return jax.lax.scan(body, x, stacked)[0]
    tokens, out = context
    n = leaves[tapped[0]].shape[0]

    def step(carry: tuple, xs: tuple) -> tuple:
        h, sums = carry
        layer, i = xs
        layer, new = list(layer), []
        for k, s in zip(tapped, sums):
            s, layer[k] = _tap(s, layer[k], i)
            new.append(s)
        h, _ = body(h, jax.tree.unflatten(treedef, layer))
        return (h, new), None

    start = [tokens[id(leaves[k])] for k in tapped]
    (x, sums), _ = jax.lax.scan(step, (x, start), (leaves, jnp.arange(n)))
    out.update({id(leaves[k]): s for k, s in zip(tapped, sums)})
    return x


def accumulator(a: jax.Array) -> jax.Array:
    """Zeros to sum microbatch gradients of ``a`` into: float32 (at least) — 16-bit sums over
    many microbatches lose the small gradients (the plain loop and the pipeline executor)."""
    return jnp.zeros(a.shape, jnp.promote_types(a.dtype, jnp.float32))
