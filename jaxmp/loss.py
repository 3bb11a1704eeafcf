"""How jaxmp calls a user's loss: ``loss_fn(model, batch)`` or ``loss_fn(model, batch, rngs)``,
returning ``loss`` or ``(loss, aux)``.

One convention for everything that runs a loss — the train step, evaluation and the cost model
that traces the training program — so a loss that wants per-step randomness (Flax's usual
``rngs`` argument for dropout) works in all of them.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

LossFn = Callable[..., Any]  # (model, batch[, rngs]) -> loss or (loss, aux)


def takes_rngs(loss_fn: LossFn) -> bool:
    """True for ``loss_fn(model, batch, rngs)``: a third positional parameter (or ``*args``),
    or a parameter named ``rngs``."""
    try:
        params = list(inspect.signature(loss_fn).parameters.values())
    except (TypeError, ValueError):  # a builtin or C callable: the plain two-argument form
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return (len(positional) >= 3 or any(p.name == "rngs" for p in params)
            or any(p.kind == p.VAR_POSITIONAL for p in params))


def call_loss(loss_fn: LossFn, model: Any, batch: Any, key: jax.Array | None = None) -> Any:
    """``loss_fn``'s raw output; a loss that takes ``rngs`` gets ``nnx.Rngs(key)``."""
    if takes_rngs(loss_fn):
        return loss_fn(model, batch, nnx.Rngs(jax.random.key(0) if key is None else key))
    return loss_fn(model, batch)


def split_loss(out: Any) -> tuple[jax.Array, dict]:
    """``loss`` or ``(loss, aux)`` → ``(loss, aux dict)``."""
    loss, aux = out if isinstance(out, tuple) else (out, {})
    return loss, dict(aux)
