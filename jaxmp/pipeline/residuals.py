"""What a pipeline chunk's forward keeps for its backward, kept without the parameters.

A pipeline runs a chunk's backward some ticks after its forward, so the forward's residuals wait
in a per-device buffer, one slot per microbatch in flight. Two things keep that buffer small:

* **Which intermediates are kept** — :func:`stash_policy`, a ``jax.checkpoint`` policy: without
  remat the matmuls' outputs, reductions and named values (:func:`jaxmp.remat.stash_keeps`:
  casts, reshapes and elementwise ops are recomputed); with a remat policy, that
  policy plus each block's input.
* **No copies of the parameters.** ``jax.vjp`` keeps the arguments it needs verbatim apart from
  the intermediates it computed: its ``vjpfun.args_res`` holds one entry per argument. The
  forward differentiates ``fn(params, x)``, and the parameters' entry is left out of what is
  stored (:func:`vjp_without_params`); the backward puts the live parameters back
  (:func:`with_params`). On jax versions that have it this is ``jax.vjp``'s documented
  ``saveable_args`` option; on older ones the same field is emptied by hand.

A stash is the vjp's pytree leaves, each stored in a ``[slots, ...]`` buffer;
:class:`StashLayout` (traced once, abstractly) holds their shapes and the tree that turns the
leaves back into a vjp function.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxmp.remat import REMAT_POLICIES, keeps_layer, stash_keeps

BLOCK_INPUT = "jaxmp_pipeline_block_input"  # the checkpoint_name of each block's input
_SAVEABLE_ARGS = "saveable_args" in inspect.signature(jax.vjp).parameters


def stash_policy(remat: str) -> Callable:
    """What a chunk's forward keeps for its backward. Without remat:
    :func:`jaxmp.remat.stash_keeps`. With a remat policy, that policy plus each block's input:
    an outer policy decides for the nested blocks too, so saving more here would undo the
    blocks' remat."""
    if keeps_layer(remat):  # "none", "selective" (its attention core recomputed by its VJP)
        return stash_keeps
    return jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.save_only_these_names(BLOCK_INPUT), REMAT_POLICIES[remat])


def vjp_without_params(fn: Callable, params: Any, x: Any) -> tuple[Any, Any]:
    """``(fn(params, x), vjp)`` where ``vjp``'s pytree leaves never hold ``params``: they are the
    intermediates kept and, if needed, ``x``. :func:`with_params` makes it callable again."""
    if _SAVEABLE_ARGS:  # the documented option: params kept verbatim become empty placeholders
        return jax.vjp(fn, params, x, saveable_args=(False, True))
    out, vjp = jax.vjp(fn, params, x)  # older jax: the same field, emptied here
    return out, dataclasses.replace(vjp, args_res=[None, *vjp.args_res[1:]])


def with_params(vjp: Any, params: Any) -> Any:
    """``vjp`` from :func:`vjp_without_params` with the live ``params`` put back."""
    return dataclasses.replace(vjp, args_res=[params, *vjp.args_res[1:]])


@dataclasses.dataclass(frozen=True)
class StashLayout:
    """The residual leaves of one chunk's forward: their shapes, and the vjp's tree."""

    avals: tuple[jax.ShapeDtypeStruct, ...]
    treedef: Any

    def empty(self, slots: int) -> list[jax.Array]:
        """One ``[slots, ...]`` zero buffer per residual leaf."""
        return [jnp.zeros((slots,) + a.shape, a.dtype) for a in self.avals]

    def check(self, leaves: list[Any]) -> None:
        """The leaves a forward traced in a tick are the ones this layout was made from."""
        got = [(tuple(a.shape), a.dtype) for a in leaves]
        if got != [(a.shape, a.dtype) for a in self.avals]:  # pragma: no cover - a jax change
            raise RuntimeError("pipeline residuals differ between traces of the same chunk")

    def vjp(self, leaves: list[jax.Array], params: Any) -> Any:
        """The vjp function again, from stored leaves and the live parameters."""
        return with_params(jax.tree.unflatten(self.treedef, leaves), params)


def stash_layout(forward: Callable, *args: Any) -> StashLayout:
    """Trace ``forward(*args) -> (outputs, vjp)`` abstractly: the layout of its residuals."""
    box: dict[str, Any] = {}

    def leaves(*args: Any) -> list:
        _, vjp = forward(*args)
        flat, box["treedef"] = jax.tree.flatten(vjp)
        if not all(isinstance(a, jax.Array) for a in flat):  # pragma: no cover - a jax change
            raise RuntimeError(f"pipeline residuals are not all arrays: "
                               f"{sorted({type(a).__name__ for a in flat})}")
        return flat

    avals = jax.eval_shape(leaves, *args)
    return StashLayout(tuple(avals), box["treedef"])
