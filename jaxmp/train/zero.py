"""Optimizer state sharded over ``data`` (ZeRO-1): one replica group keeps one copy of Adam.

Without it every data replica holds the same Adam moments and computes the same update: with
float32 moments that is 8 bytes per parameter per device that data parallelism never divides.
With ``train.optimizer_sharding = "data"`` (a :class:`~jaxmp.plan.Layout` decision):

* the moments (every params-shaped array of the optimizer state) get ``data`` appended to one
  of their dims (:func:`jaxmp.sharding.optimizer.over_data`), on top of what fsdp / tensor /
  stage already cut;
* inside the step the reduced gradient and the params are constrained to those slices, so the
  data-axis all-reduce becomes a reduce-scatter (XLA's, or the reducer's ``psum_scatter``), each
  device runs the optimizer on its slice only, and the updated slices are all-gathered back
  into the params every replica computes with: reduce-scatter + all-gather move the bytes of
  the all-reduce they replace.

The parameters each replica computes with stay whole (ZeRO-1/2 as in Megatron's distributed
optimizer, MaxText's ``shard_optimizer_over_data`` and PyTorch FSDP's ``SHARD_GRAD_OP``: a
full replica for the forward and backward, the optimizer sharded). jaxmp stores the params in
``model.param_dtype`` and casts them to the compute dtype in the forward, so with the default
float32 params the master copy *is* the params and stays replicated over data; what is divided
is the optimizer's state and its update (docs/architecture.md compares the byte counts).

Checkpoints store logical names, not shardings, so a run saved with it restores without it
(and on another data size) with identical values: only the target shardings differ.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax
import optax
from flax import nnx
from jax.sharding import NamedSharding

from jaxmp.mesh import mesh_shape
from jaxmp.sharding.optimizer import DATA, data_dim, over_data
from jaxmp.train.state import StateLayout

def _shape(x: Any) -> tuple[int, ...]:
    leaves = jax.tree.leaves(x)
    return tuple(leaves[0].shape) if leaves else ()


def sliced(sharding: NamedSharding, x: Any) -> NamedSharding:
    """``sharding`` with ``x`` (an array or a Variable of one) cut over data as well."""
    sizes = mesh_shape(sharding.mesh)
    return NamedSharding(sharding.mesh, over_data(sharding.spec, _shape(x), sizes))


def _is_sharding(x: Any) -> bool:
    return isinstance(x, NamedSharding)


def shard_state(layout: StateLayout) -> StateLayout:
    """``layout`` with its optimizer state sharded over data as well (params untouched)."""
    opt = jax.tree.map(sliced, layout.shardings.opt_state, layout.abstract.opt_state,
                       is_leaf=_is_sharding)
    return dataclasses.replace(layout,
                               shardings=layout.shardings.replace(opt_state=opt))


def scatter_dims(layout: StateLayout) -> list[int | None]:
    """Per param leaf (flattened order), the dim its data slice cuts (None: not sliced)."""
    sizes = mesh_shape(layout.mesh)
    return [data_dim(s.spec, _shape(x), sizes) for s, x in zip(
        jax.tree.leaves(layout.shardings.params, is_leaf=_is_sharding),
        jax.tree.leaves(layout.abstract.params, is_leaf=lambda v: isinstance(v, nnx.Variable)),
        strict=True)]


def _uses_data(shardings: Any) -> bool:
    return any(DATA in ((e,) if isinstance(e, str) else tuple(e or ()))
               for s in jax.tree.leaves(shardings, is_leaf=_is_sharding) for e in s.spec)


def built(layout: StateLayout, params: Any = None) -> str:
    """What the built state does, read from its shardings: ``"data"`` when optimizer arrays
    are cut over ``data`` while the params the model computes with (``params``: default the
    state's; with master weights the model's, :mod:`jaxmp.train.master`) are not, else
    ``"none"``."""
    opt = layout.shardings.opt_state
    params = layout.shardings.params if params is None else params
    return "data" if _uses_data(opt) and not _uses_data(params) else "none"


@dataclass(frozen=True)
class ShardedUpdate:
    """The optimizer step on data slices: ``(params, opt_state, grads) = self(tx, grads,
    opt_state, params)`` — ``grads`` returned as the sliced gradient (its norm is the same)."""

    params: Any  # the params' shardings (what every replica computes with)
    slices: Any  # the same arrays cut over data as well (where the optimizer runs)

    @classmethod
    def of(cls, layout: StateLayout) -> ShardedUpdate:
        slices = jax.tree.map(sliced, layout.shardings.params, layout.abstract.params,
                              is_leaf=_is_sharding)
        return cls(layout.shardings.params, slices)

    def __call__(self, tx: optax.GradientTransformation, grads: Any, opt_state: Any,
                 params: Any) -> tuple[Any, Any, Any]:
        wsc = jax.lax.with_sharding_constraint
        grads = wsc(grads, self.slices)  # the all-reduce becomes a reduce-scatter
        mine = wsc(params, self.slices)  # a local slice: no communication
        updates, opt_state = tx.update(grads, opt_state, mine)
        new = wsc(optax.apply_updates(mine, updates), self.params)  # all-gather
        return new, opt_state, grads
