"""The train step: one ``jax.jit`` with explicit shardings and a donated state.

XLA inserts every collective: parameters arrive sharded as the rules say, the batch arrives split
over (data, fsdp), activations are pinned by logical name inside the model (and, for models that
name none, by their batch dim at layer boundaries: :mod:`jaxmp.train.pinning`), and the outputs
are pinned to the same shardings as the inputs, so GSPMD has no freedom to pick something worse.

Gradient accumulation runs *inside* the step, a loop over k microbatches, rather than with
``optax.MultiSteps``: no parameter-sized accumulator lives in the optimizer state between
steps, and one host call still makes one update.

Randomness: a loss that takes a third argument, ``loss_fn(model, batch, rngs)``, gets a fresh
``nnx.Rngs`` every step (and microbatch), derived from ``train.seed`` and the step counter held
in the state — so dropout differs step to step, and a resumed run draws exactly the same keys.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxmp import gradsum, sharding
from jaxmp.compression.gather import WeightGather
from jaxmp.compression.reduce import Reducer, per_replica, without_data
from jaxmp.loss import LossFn, call_loss, split_loss
from jaxmp.train.guard import NonFiniteGuard
from jaxmp.train.master import MasterWeights
from jaxmp.train.pinning import pin_batch, pinned_layers
from jaxmp.train.state import StateLayout, TrainState
from jaxmp.train.zero import ShardedUpdate

BATCH_NAMES = ("batch",)
_TRAIN_STREAM, _EVAL_STREAM = 1, 2  # folded into the seed's key: never the init key


def batch_spec(mesh: Any, rules: Sequence, rows: int) -> PartitionSpec:
    """Where a global batch of ``rows`` lives: its leading dim by the logical name ``batch``."""
    return sharding.logical_spec(BATCH_NAMES, (rows,), mesh, rules)


def batch_sharding(layout: StateLayout, rules: Sequence, batch: dict) -> dict:
    """Shard every batch array's leading dim by the logical name ``batch``."""
    return {k: NamedSharding(layout.mesh, batch_spec(layout.mesh, rules, v.shape[0]))
            for k, v in batch.items()}


def step_key(seed: int, step: jax.Array | int, stream: int = _TRAIN_STREAM) -> jax.Array:
    """The key of one step: a function of the seed and the step only (bitwise resume)."""
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), stream), step)


def make_grad_fn(layout: StateLayout, loss_fn: LossFn, grad_accum: int = 1,
                 rules: Sequence = sharding.DEFAULT_RULES, gather: WeightGather | None = None,
                 keep_weight: bool = False, wide_grads: bool = False,
                 sum_in_backward: bool = False) -> Callable:
    """``(params, rest, batch, key=None) -> (loss, grads, rest, aux)``, averaged over
    microbatches (microbatch j uses ``fold_in(key, j)``).

    Microbatches are weighted by ``aux["weight"]`` when the loss provides it (token counts), so
    the accumulated step equals the full-batch step even when masks differ between them
    (``keep_weight``: the total stays in ``aux["weight"]``). ``gather``: fsdp weights are
    gathered in a narrower dtype (:mod:`jaxmp.compression.gather`). Microbatch gradients
    are summed in float32 (at least); ``wide_grads`` returns that sum as is (master weights
    update in float32), else in each param's dtype. ``sum_in_backward``: a layer stack run by
    :func:`jaxmp.gradsum.scan_layers` adds each layer's gradient into the float32 sum inside
    the backward pass (no whole microbatch gradient beside the sum; same values).
    """
    graphdef, mesh = layout.graphdef, layout.mesh

    def loss_of(params: Any, rest: Any, batch: dict, key: jax.Array, weighted: bool = True,
                tokens: list | None = None) -> tuple[jax.Array, tuple]:
        if gather is not None:
            params = gather.prepare(params)
        model = nnx.merge(graphdef, params, rest, copy=True)
        rows = int(jax.tree.leaves(batch)[0].shape[0])
        batch = pin_batch(batch, rows, mesh, rules)
        # tokens: per param leaf, the float32 running sum's stand-in (jaxmp.gradsum), keyed by
        # the leaf the model sees (after the gather's cast)
        seen = jax.tree.leaves(params)
        taps = {} if tokens is None else {id(p): t for p, t in zip(seen, tokens, strict=True)}
        with pinned_layers(model, rows, mesh, rules), sharding.param_gathering(gather), \
                gradsum.summing_into(taps) as carried:
            loss, aux = split_loss(call_loss(loss_fn, model, batch, key))
        weight = aux.pop("weight", jnp.float32(1.0))
        _, _, new_rest = nnx.split(model, nnx.Param, ...)
        out = None if tokens is None else [carried.get(id(p)) for p in seen]
        return (loss * weight if weighted else loss), (weight, new_rest, aux, out)

    value_and_grad = jax.value_and_grad(loss_of, has_aux=True)

    def micro(params: Any, rest: Any, batch: dict, key: jax.Array, weighted: bool = True
              ) -> tuple:
        (wloss, (weight, rest, aux, _)), grads = value_and_grad(params, rest, batch, key,
                                                                weighted)
        return wloss, weight, grads, rest, aux

    def micro_into(params: Any, rest: Any, batch: dict, key: jax.Array, sums: Any) -> tuple:
        """:func:`micro` whose gradients come back added into ``sums`` (float32): the loss's
        vector-Jacobian product with the sums as the cotangent of their tokens."""
        treedef = jax.tree.structure(params)
        tapped: set[int] = set()

        def of(params: Any, tokens: list) -> tuple:
            wloss, (weight, rest_, aux, carried) = loss_of(params, rest, batch, key, True,
                                                           tokens)
            tapped.update(k for k, c in enumerate(carried) if c is not None)
            return (wloss, [t if c is None else c for c, t in zip(carried, tokens)]), \
                (weight, rest_, aux)

        sum_leaves = treedef.flatten_up_to(sums)
        zeros = [jnp.zeros(s.shape, s.dtype) for s in sum_leaves]
        (wloss, _), vjp, (weight, rest, aux) = jax.vjp(of, params, zeros, has_aux=True)
        ct_params, ct_tokens = vjp((jnp.ones_like(wloss), sum_leaves))
        grads = [t if k in tapped else t + g.astype(t.dtype)
                 for k, (g, t) in enumerate(zip(treedef.flatten_up_to(ct_params), ct_tokens))]
        return wloss, weight, jax.tree.unflatten(treedef, grads), rest, aux

    def grad_fn(params: Any, rest: Any, batch: dict, key: jax.Array | None = None) -> tuple:
        key = jax.random.key(0) if key is None else key
        with sharding.activation_sharding(layout.mesh, rules):
            if grad_accum == 1:  # one batch: its loss as is (re-weighting costs a pass over
                loss, _, grads, rest, aux = micro(params, rest, batch, key, False)  # the grads)
                return loss, grads, rest, aux
            wloss, weight, grads, rest, aux = _accumulate(micro, params, rest, batch, key,
                                                          grad_accum,
                                                          micro_into if sum_in_backward else None)
            scale = 1.0 / jnp.maximum(weight, 1e-12)
            grads = jax.tree.map(lambda g, p: g * scale if wide_grads else
                                 (g * scale).astype(p.dtype), grads, params)
            return wloss * scale, grads, rest, {**aux, "weight": weight} if keep_weight else aux

    return grad_fn


def _accumulate(micro: Callable, params: Any, rest: Any, batch: dict, key: jax.Array,
                k: int, micro_into: Callable | None = None) -> tuple:
    """Sum weighted losses and gradients over k microbatches in one loop.

    Microbatch j takes rows j, j+k, j+2k, ... so that every device keeps contributing to every
    microbatch (the batch dim is sharded in contiguous blocks). ``micro_into`` (the sum in,
    the sum out) adds inside the backward pass instead of after it.

    The loop's trip count is hidden from XLA (its bound passes an optimization barrier). Why:
    XLA's GPU double-buffering unrolls every loop of known trip count that holds a collective
    (jaxmp turns it on for the layer loops' sake) and peels an iteration of this one; the
    scheduler then made the peeled microbatch's residual stacks (their zero-filled buffers)
    before the loop, live through every other microbatch: float32, 4 layers, seq 2048 on
    deviceless H200s, 2 microbatches took 8.0 GiB against 5.4 GiB for one (docs/planner.md
    §7 "Stop 34"). With no known trip count the loop stays one microbatch deep; nothing is
    pipelined across its iterations either.

    Each iteration's microbatch arrives in the loop's carry (sliced one iteration ahead), not
    as an input sliced by the iteration index: a carried value is not loop-invariant, so
    XLA's collective pipeliner never moves work of the next microbatch into this iteration
    (with sequence parallelism it once re-ran the whole forward of the next microbatch each
    iteration to pipeline the head's gather: docs/planner.md §7).
    """

    def split(x: jax.Array) -> jax.Array:
        if x.shape[0] % k:
            raise ValueError(f"batch of {x.shape[0]} rows is not divisible by grad_accum={k}")
        mb = x.reshape((x.shape[0] // k, k) + x.shape[1:]).swapaxes(0, 1)
        names = (None,) + BATCH_NAMES + (None,) * (x.ndim - 1)
        return sharding.constrain(mb, names)

    micro_batches = jax.tree.map(split, batch)
    zeros = jax.tree.map(gradsum.accumulator, params)

    def pick(j: jax.Array) -> dict:  # microbatch j
        return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, j, 0, keepdims=False),
                            micro_batches)

    def one(j: jax.Array, loss_sum: jax.Array, w_sum: jax.Array, g_sum: Any, rest: Any,
            mb: dict) -> tuple:
        upcoming = pick(jnp.minimum(j + 1, k - 1))  # the next iteration's (the last: again)
        mb_key = jax.random.fold_in(key, j)
        if micro_into is not None:
            wloss, weight, g_sum, rest, aux = micro_into(params, rest, mb, mb_key, g_sum)
        else:
            wloss, weight, grads, rest, aux = micro(params, rest, mb, mb_key)
            g_sum = jax.tree.map(jnp.add, g_sum, grads)
        return (loss_sum + wloss, w_sum + weight, g_sum, rest, upcoming), aux

    first = (jnp.float32(0.0), jnp.float32(0.0), zeros, rest, pick(jnp.int32(0)))
    aux_type = jax.eval_shape(lambda: one(jnp.int32(0), *first)[1])
    aux_zero = jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), aux_type)
    stop = jax.lax.optimization_barrier(jnp.int32(k))  # k, unknown to XLA's loop passes

    def body(carry: tuple) -> tuple:
        j, state, aux_sum = carry
        state, aux = one(j, *state)
        return j + 1, state, jax.tree.map(lambda s, a: s + a.astype(s.dtype), aux_sum, aux)

    _, (loss, weight, grads, rest, _), aux_sum = jax.lax.while_loop(
        lambda carry: carry[0] < stop, body, (jnp.int32(0), first, aux_zero))
    aux = jax.tree.map(lambda s, a: (s / k).astype(jnp.result_type(a.dtype, jnp.float32)),
                       aux_sum, aux_type)
    return loss, weight, grads, rest, aux


def make_train_step(layout: StateLayout, loss_fn: LossFn, tx: optax.GradientTransformation,
                    schedule: optax.Schedule, example_batch: dict, grad_accum: int = 1,
                    rules: Sequence = sharding.DEFAULT_RULES, seed: int = 0,
                    grad_fn: Callable | None = None, reducer: Reducer | None = None,
                    gather: WeightGather | None = None,
                    guard: NonFiniteGuard | None = None,
                    zero: ShardedUpdate | None = None,
                    master: MasterWeights | None = None,
                    sum_in_backward: bool = False) -> Callable:
    """Return the jitted ``step(state, batch) -> (state, metrics)`` with donated state.

    ``grad_fn`` replaces the plain gradient (e.g. the pipeline executor's, same contract; built
    with :func:`~jaxmp.compression.reduce.without_data` rules when there is a ``reducer``).
    ``reducer``: gradients are computed per data replica and reduced over ``data`` once per
    step by it (:mod:`jaxmp.compression.reduce`); without one XLA reduces them where they arise.
    ``guard`` skips non-finite updates (its counters must be in the layout's ``extra``).
    ``zero``: the optimizer runs on data slices (:mod:`jaxmp.train.zero`; the layout's
    optimizer state must be sharded so: :func:`jaxmp.train.zero.shard_state`). ``master``:
    the state's params are a float32 master of the model's 16-bit params
    (:mod:`jaxmp.train.master`): the model computes with their cast, the optimizer updates
    the master (on its data slices when the master is cut over data). ``sum_in_backward``:
    microbatch gradients of scanned layer stacks are added into the float32 sum inside the
    backward pass (:mod:`jaxmp.gradsum`).
    """
    wide = master is not None
    if reducer is None:
        grad_fn = grad_fn or make_grad_fn(layout, loss_fn, grad_accum, rules, gather,
                                          wide_grads=wide, sum_in_backward=sum_in_backward)
    else:
        grad_fn = per_replica(grad_fn or make_grad_fn(layout, loss_fn, grad_accum,
                                                      without_data(rules), gather, True, wide,
                                                      sum_in_backward),
                              layout.mesh, master.compute_shardings if wide
                              else layout.shardings.params)

    def step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        key = step_key(seed, state.step)
        computed = state.params if master is None else master.compute(state.params)
        loss, grads, rest, aux = grad_fn(computed, state.rest, batch, key)
        extra = state.extra
        if reducer is not None:
            grads, extra = reducer(grads, extra)
        if master is not None:  # the float32 master updated on its (data) slices
            params, opt_state, grads = master(tx, grads, state.opt_state, state.params)
        elif zero is not None:  # optimizer state sharded over data (ZeRO-1)
            params, opt_state, grads = zero(tx, grads, state.opt_state, state.params)
        else:  # gradients laid out as their params: where the model's compute dtype is the
            # params' (no cast to reduce-scatter before), XLA otherwise all-reduced a whole
            # fsdp-split table to take the clipping norm of it (docs/planner.md "Stop 32 (Sw)")
            grads = jax.lax.with_sharding_constraint(grads, layout.shardings.params)
            updates, opt_state = tx.update(grads, state.opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads),
                   "lr": schedule(state.step), **aux}
        new = state.replace(step=state.step + 1, params=params, opt_state=opt_state, rest=rest,
                            extra=extra)
        if guard is not None:  # non-finite loss or gradient: keep the old state (train/guard.py)
            new, guarded = guard.apply(state, new, loss, metrics["grad_norm"])
            metrics.update(guarded)
        return new, metrics

    replicated = NamedSharding(layout.mesh, PartitionSpec())
    batch_in = batch_sharding(layout, rules, example_batch)
    return jax.jit(step, in_shardings=(layout.shardings, batch_in),
                   out_shardings=(layout.shardings, replicated), donate_argnums=(0,))


def make_eval_step(layout: StateLayout, loss_fn: LossFn, example_batch: dict,
                   rules: Sequence = sharding.DEFAULT_RULES, seed: int = 0,
                   pipeline_loss: Callable | None = None,
                   master: MasterWeights | None = None) -> Callable:
    """Return the jitted ``eval(state, batch) -> loss``: no state change, the model in
    evaluation mode (``nnx.Module.eval()``: dropout off). ``pipeline_loss(params, rest, batch)
    -> loss`` replaces the plain forward under pipeline stages (the executor's forward-only
    :meth:`~jaxmp.pipeline.executor.PipelineExecutor.eval_fn`, in evaluation mode too).
    ``master``: the model evaluates with the cast of the float32 master, as it trains."""

    def evaluate(state: TrainState, batch: dict) -> jax.Array:
        params = state.params if master is None else master.compute(state.params)
        if pipeline_loss is not None:
            return pipeline_loss(params, state.rest, batch)
        with sharding.activation_sharding(layout.mesh, rules):
            model = nnx.merge(layout.graphdef, params, state.rest, copy=True)
            model.eval()
            rows = int(jax.tree.leaves(batch)[0].shape[0])
            with pinned_layers(model, rows, layout.mesh, rules):
                out = call_loss(loss_fn, model, pin_batch(batch, rows, layout.mesh, rules),
                                step_key(seed, 0, _EVAL_STREAM))
            return split_loss(out)[0]

    replicated = NamedSharding(layout.mesh, PartitionSpec())
    batch_in = batch_sharding(layout, rules, example_batch)
    return jax.jit(evaluate, in_shardings=(layout.shardings, batch_in), out_shardings=replicated)
