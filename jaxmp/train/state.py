"""Train state that is born sharded: created inside ``jax.jit`` with ``out_shardings``.

The model is split once into a static ``graphdef`` and two pytrees: ``params`` (``nnx.Param``
variables, what the optimizer updates) and ``rest`` (everything else: RNG streams, batch stats).
Optax's state mirrors ``params`` variable by variable, and Variables keep their metadata through
``jax.tree.map``, so one call to ``sharding.shardings_for`` shards params, Adam moments and the
rest alike, from the same logical names. No array of the state is ever materialised on one device.

``extra`` holds state that training features add beside the model's (for example error-feedback
residuals shaped like the params, or guard counters): each feature names an *extension*, a
function of the params that builds its subtree. Arrays in Variables keep their logical names, so
extras are sharded and checkpointed exactly like params without changing the state's shape.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxmp import sharding
from jaxmp._util.arrays import nbytes

ModelFn = Callable[[nnx.Rngs], nnx.Module]
Extension = Callable[[Any], Any]  # params (Variables, real or abstract) -> an extra subtree
Transform = Callable[[nnx.State], nnx.State]  # the model's params -> the layout stored


@flax.struct.dataclass
class TrainState:
    """Everything a step reads and writes; a pytree, so jit/Orbax handle it whole."""

    step: jax.Array
    params: Any
    opt_state: Any
    rest: Any
    extra: dict[str, Any] = flax.struct.field(default_factory=dict)


@dataclass
class StateLayout:
    """The static half of a train state: graph, abstract shapes and shardings."""

    graphdef: Any
    abstract: TrainState  # TrainState of ShapeDtypeStruct-valued Variables
    shardings: TrainState  # a pytree prefix of the state: NamedSharding per Variable/array
    mesh: Mesh
    extensions: Mapping[str, Extension] = field(default_factory=dict)
    transform: Transform | None = None  # e.g. pipeline stages' padded layout of a layer stack


def _split(model: nnx.Module) -> tuple[Any, Any, Any]:
    return nnx.split(model, nnx.Param, ...)


def _build(model_fn: ModelFn, tx: optax.GradientTransformation, rngs: nnx.Rngs,
           extensions: Mapping[str, Extension], transform: Transform | None,
           given: Any = None) -> TrainState:
    """A fresh state at step 0: the model's params and rest, the optimizer's state, extras.

    ``given``: params as a pure dict (plain layer layout, any float dtype) that replace the
    random ones, cast to each param's dtype (the random init is then dead code to XLA)."""
    _, params, rest = _split(model_fn(rngs))
    if given is not None:
        dtypes = nnx.to_pure_dict(params)
        nnx.replace_by_pure_dict(params, jax.tree.map(lambda x, like: x.astype(like.dtype),
                                                      given, dtypes))
    if transform is not None:
        params = transform(params)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                      rest=rest, extra={k: make(params) for k, make in extensions.items()})


def plan_state(model_fn: ModelFn, tx: optax.GradientTransformation, mesh: Mesh,
               rules: Sequence = sharding.DEFAULT_RULES, path_rules: Sequence | None = None,
               extensions: Mapping[str, Extension] | None = None,
               transform: Transform | None = None) -> StateLayout:
    """Trace the model abstractly (no FLOPs, no memory) and derive the state's shardings.

    ``extensions`` add extra state (see the module docstring); ``transform`` maps the model's
    params to the layout the state stores (the pipeline's padded stages)."""
    extensions = dict(extensions or {})
    graphdef, _, _ = _split(sharding.abstract(lambda: model_fn(nnx.Rngs(0))))
    with sharding.without_eager_sharding():
        abstract = jax.eval_shape(lambda: _build(model_fn, tx, nnx.Rngs(0), extensions,
                                                 transform))
    shardings = sharding.shardings_for(abstract, mesh, rules=rules, path_rules=path_rules)
    return StateLayout(graphdef=graphdef, abstract=abstract, shardings=shardings, mesh=mesh,
                       extensions=extensions, transform=transform)


def init_state(layout: StateLayout, model_fn: ModelFn, tx: optax.GradientTransformation,
               seed: int, params: Any = None) -> TrainState:
    """Create params, optimizer state and extras directly in their shards (inside jit).

    ``params``: start from these (a pure dict of arrays, e.g. a params-only checkpoint such
    as an imported Hugging Face model) with a fresh optimizer state, instead of random ones."""
    key = jax.random.key_data(jax.random.key(seed))
    replicated = NamedSharding(layout.mesh, PartitionSpec())
    init = jax.jit(lambda k, given: _build(model_fn, tx, nnx.Rngs(jax.random.wrap_key_data(k)),
                                           layout.extensions, layout.transform, given),
                   in_shardings=(replicated, jax.tree.map(lambda x: x.sharding, params)),
                   out_shardings=layout.shardings)
    with sharding.without_eager_sharding():  # traced here: the model is built inside
        return init(key, params)


def addressable_bytes(tree: Any) -> int:
    """Bytes the first local device holds of ``tree``: what sharding actually saves."""
    dev = jax.local_devices()[0]
    return sum(nbytes(shard.data) for x in jax.tree.leaves(tree)
               for shard in x.addressable_shards if shard.device == dev)
