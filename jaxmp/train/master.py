"""Float32 master weights beside 16-bit params (``train.master_weights``).

A model built with 16-bit params (``model.param_dtype = "bfloat16"``) computes its forward and
backward with them, but an optimizer that adds ``lr x update`` to a bfloat16 weight loses
every update smaller than the weight's last bit. Mixed-precision training therefore keeps a
float32 *master* copy that the optimizer updates (Megatron's "main params", NeMo's O2, Apex's
master weights, torchtitan's FSDP ``MixedPrecisionPolicy(param_dtype=bfloat16)``):

* the train state's ``params`` **are** the float32 master (:class:`Upcast`, the state's
  layout transform), sharded like the optimizer's moments — over ``data`` as well when
  ``train.optimizer_sharding = "data"`` (:func:`shard_params`);
* each step casts the master to the model's own dtypes and constrains the copy to the model's
  shardings (:meth:`MasterWeights.compute`): with the master cut over data that is an
  all-gather of 16-bit params, the params every replica computes with;
* the gradients (16-bit from the backward pass, accumulated over microbatches in float32) are
  cast to float32 and constrained to the master's slices — the data all-reduce becomes a
  reduce-scatter — and the optimizer updates each device's float32 slice.

Per parameter and device that is ``2 + 4 + 12/data`` bytes at the step's peak (the 16-bit copy,
float32 gradients, master and moments sharded over data) where Megatron's distributed
optimizer holds ``6 + 12/data``; float32 params with the optimizer sharded hold
``4 + 4 + 8/data``. The 16-bit copy lives only during the step (gathered at its start, the
bytes Megatron gathers at the end of the previous one), so a checkpoint holds the float32
master as its params: a run saved with master weights restores without them (float32 params)
with identical values, and the other way round.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding

from jaxmp.train.state import StateLayout, Transform
from jaxmp.train.zero import sliced

MASTER_DTYPE = jnp.float32


def narrow(dtype: Any) -> bool:
    """A floating dtype narrower than the master's (bfloat16, float16)."""
    dtype = jnp.dtype(dtype)
    return jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4


def narrowest(params: Any) -> str | None:
    """The narrowest floating dtype among ``params``' leaves (None: no floating leaf)."""
    floats = [jnp.dtype(x.dtype) for x in jax.tree.leaves(params)
              if jnp.issubdtype(x.dtype, jnp.floating)]
    return min(floats, key=lambda d: d.itemsize).name if floats else None


class Upcast:
    """The state's layout transform with master weights: the model's params (after ``inner``,
    e.g. the pipeline's stages) in float32. ``dtypes`` records, per leaf, the dtype the model
    computes in — set when the state is traced (the dtypes are static)."""

    def __init__(self, inner: Transform | None = None):
        self.inner = inner
        self.dtypes: list[Any] | None = None

    def __call__(self, params: Any) -> Any:
        if self.inner is not None:
            params = self.inner(params)
        self.dtypes = [jnp.dtype(x.dtype) for x in jax.tree.leaves(params)]
        return jax.tree.map(lambda x: x.astype(MASTER_DTYPE) if narrow(x.dtype) else x, params)


def shard_params(layout: StateLayout) -> StateLayout:
    """``layout`` with the master (its params) cut over data like the optimizer's moments."""
    params = jax.tree.map(sliced, layout.shardings.params, layout.abstract.params,
                          is_leaf=lambda x: isinstance(x, NamedSharding))
    return dataclasses.replace(layout, shardings=layout.shardings.replace(params=params))


def built(layout: StateLayout) -> str:
    """``"float32"`` when the built state keeps a float32 master of narrower model params
    (read from its transform and stored dtypes), else ``"none"``."""
    up = layout.transform
    if not isinstance(up, Upcast) or up.dtypes is None:
        return "none"
    stored = [jnp.dtype(x.dtype) for x in jax.tree.leaves(layout.abstract.params)]
    return "float32" if any(narrow(d) and s != d for d, s in zip(up.dtypes, stored)) \
        else "none"


@dataclass(frozen=True)
class MasterWeights:
    """The step's two halves of master weights: :meth:`compute` (the 16-bit params the model
    runs with) and ``self(tx, grads, opt_state, master)`` (the float32 update)."""

    compute_shardings: Any  # the model's shardings (what every replica computes with)
    master_shardings: Any  # the master's (cut over data with the optimizer's state)
    dtypes: tuple[Any, ...]  # per leaf, the model's own dtype

    @classmethod
    def of(cls, layout: StateLayout, compute_shardings: Any) -> MasterWeights:
        assert isinstance(layout.transform, Upcast) and layout.transform.dtypes is not None
        return cls(compute_shardings, layout.shardings.params, tuple(layout.transform.dtypes))

    def compute(self, master: Any) -> Any:
        """The master in the model's dtypes, on the model's shardings (an all-gather of the
        16-bit copy when the master is cut over data)."""
        wsc = jax.lax.with_sharding_constraint
        leaves, treedef = jax.tree.flatten(master)
        cast = jax.tree.unflatten(treedef, [x.astype(d) for x, d in zip(leaves, self.dtypes,
                                                                          strict=True)])
        # cast on the master's slices, then gathered: the all-gather moves 16-bit params
        return wsc(wsc(cast, self.master_shardings), self.compute_shardings)

    def __call__(self, tx: optax.GradientTransformation, grads: Any, opt_state: Any,
                 master: Any) -> tuple[Any, Any, Any]:
        """``(master, opt_state, grads)`` after one float32 update on the master's slices."""
        # the data all-reduce becomes a reduce-scatter, in the gradients' dtype (16-bit from
        # one backward pass, float32 summed over microbatches), then widened on the slice
        grads = jax.lax.with_sharding_constraint(grads, self.master_shardings)
        grads = jax.tree.map(lambda g: g.astype(MASTER_DTYPE) if narrow(g.dtype) else g, grads)
        updates, opt_state = tx.update(grads, opt_state, master)
        return optax.apply_updates(master, updates), opt_state, grads
