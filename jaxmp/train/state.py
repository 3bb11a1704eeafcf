"""Train state that is born sharded: created inside ``jax.jit`` with ``out_shardings``.

The model is split once into a static ``graphdef`` and two pytrees: ``params`` (``nnx.Param``
variables, what the optimizer updates) and ``rest`` (everything else: RNG streams, batch stats).
Optax's state mirrors ``params`` variable by variable, and Variables keep their metadata through
``jax.tree.map``, so one call to ``rules.specs_for`` shards params, Adam moments and the rest
alike, from the same logical names. No array of the state is ever materialised on one device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxmp import rules as rules_lib

ModelFn = Callable[[nnx.Rngs], nnx.Module]


@flax.struct.dataclass
class TrainState:
    """Everything a step reads and writes; a pytree, so jit/Orbax handle it whole."""

    step: jax.Array
    params: Any
    opt_state: Any
    rest: Any


@dataclass(frozen=True)
class OptimizerSpec:
    """The optimizer hyper-parameters the trainer needs (a subset of the config section)."""

    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    clip_norm: float = 1.0


def make_schedule(opt: OptimizerSpec, total_steps: int) -> optax.Schedule:
    """Linear warmup to ``lr`` then cosine decay to ``lr * min_lr_ratio`` at ``total_steps``."""
    warmup = min(opt.warmup_steps, max(total_steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=opt.lr, warmup_steps=warmup,
        decay_steps=max(total_steps, warmup + 1), end_value=opt.lr * opt.min_lr_ratio)


def make_optimizer(opt: OptimizerSpec, total_steps: int) -> optax.GradientTransformation:
    """AdamW with global-norm clipping; no weight decay on vectors (norm scales, biases)."""
    schedule = make_schedule(opt, total_steps)

    def decay_mask(params: Any) -> Any:
        return jax.tree.map(lambda p: p.ndim >= 2, params)

    chain = [optax.clip_by_global_norm(opt.clip_norm)] if opt.clip_norm > 0 else []
    chain.append(optax.adamw(schedule, b1=opt.beta1, b2=opt.beta2, eps=opt.eps,
                             weight_decay=opt.weight_decay, mask=decay_mask))
    return optax.chain(*chain)


@dataclass
class StateLayout:
    """The static half of a train state: graph, abstract shapes and shardings."""

    graphdef: Any
    abstract: TrainState  # TrainState of ShapeDtypeStruct-valued Variables
    shardings: TrainState  # a pytree prefix of the state: NamedSharding per Variable/array
    mesh: Mesh

    @property
    def param_shardings(self) -> Any:
        return self.shardings.params


def _split(model: nnx.Module) -> tuple[Any, Any, Any]:
    return nnx.split(model, nnx.Param, ...)


def _build(model_fn: ModelFn, tx: optax.GradientTransformation, rngs: nnx.Rngs) -> TrainState:
    """A fresh state at step 0: the model's params and rest, and the optimizer's state."""
    _, params, rest = _split(model_fn(rngs))
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                      rest=rest)


def plan_state(model_fn: ModelFn, tx: optax.GradientTransformation, mesh: Mesh,
               rules: Sequence = rules_lib.DEFAULT_RULES,
               path_rules: Sequence | None = None) -> StateLayout:
    """Trace the model abstractly (no FLOPs, no memory) and derive the state's shardings."""

    graphdef, _, _ = _split(nnx.eval_shape(lambda: model_fn(nnx.Rngs(0))))
    abstract = jax.eval_shape(lambda: _build(model_fn, tx, nnx.Rngs(0)))
    shardings = rules_lib.shardings_for(abstract, mesh, rules=rules, path_rules=path_rules)
    return StateLayout(graphdef=graphdef, abstract=abstract, shardings=shardings, mesh=mesh)


def init_state(layout: StateLayout, model_fn: ModelFn, tx: optax.GradientTransformation,
               seed: int) -> TrainState:
    """Create params and optimizer state directly in their shards (inside jit)."""

    key = jax.random.key_data(jax.random.key(seed))
    replicated = NamedSharding(layout.mesh, PartitionSpec())
    init = jax.jit(lambda k: _build(model_fn, tx, nnx.Rngs(jax.random.wrap_key_data(k))),
                   in_shardings=replicated, out_shardings=layout.shardings)
    return init(key)


def merge_model(layout: StateLayout, state: TrainState) -> nnx.Module:
    """Rebuild the NNX module from a state (e.g. for evaluation or export)."""
    return nnx.merge(layout.graphdef, state.params, state.rest)


def _nbytes(x: Any) -> int:
    """Bytes of an array or ShapeDtypeStruct; typed PRNG keys count their key data."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.eval_shape(jax.random.key_data, x)
    return int(x.size) * jnp.dtype(x.dtype).itemsize


def state_bytes(tree: Any) -> int:
    """Total bytes of all arrays in ``tree`` (global, not per device)."""
    return sum(_nbytes(x) for x in jax.tree.leaves(tree))


def addressable_bytes(tree: Any) -> int:
    """Bytes the first local device holds of ``tree``: what sharding actually saves."""
    dev = jax.local_devices()[0]
    total = 0
    for x in jax.tree.leaves(tree):
        for shard in x.addressable_shards:
            if shard.device == dev:
                total += _nbytes(shard.data)
    return total
