"""The pipeline executor: a model split by layers over the ``stage`` mesh axis, inside the one
jitted train step.

``mesh.stage = P > 1`` runs the model as ``pre`` → stacked blocks → ``post`` (a
:class:`PipelineSpec`, from the recipe) under ``jax.shard_map`` over ``stage`` only: the other
axes (data, fsdp, tensor) stay automatic, so each stage is still sharded by the rules and XLA
inserts their collectives as usual. Each device runs the tick table of a
:class:`~jaxmp.pipeline.schedule.Schedule`: per tick at most one forward and one backward of a
(microbatch, chunk), then ``ppermute`` sends activations one device on and cotangents one back.

* Uneven chunks: the stacked block params are stored padded (:mod:`jaxmp.pipeline.stages`); a
  chunk runs ``lax.cond(i < n_blocks)`` per row, so padding rows are never computed.
* Backward: a forward keeps the residuals of ``jax.vjp`` in a slot of a per-device buffer (the
  schedule bounds how many are in flight); parameters and the batch are not copied into it —
  residuals that *are* them are taken from the live values at backward time. Cheap ops (casts,
  slices, reshapes) are recomputed rather than kept (a ``jax.checkpoint`` policy).
* Gradients of the stacked blocks stay on their stage; those of the shared params (embedding,
  head) are summed over stages, as a tied embedding's two uses require.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from jaxmp import sharding
from jaxmp.loss import split_loss
from jaxmp.pipeline.schedule import Schedule
from jaxmp.pipeline.stages import StageSplit
from jaxmp.remat import REMAT_POLICIES, checkpointed
from jaxmp.sharding.tree import ROWS_KEY

STAGE = "stage"
_CHEAP = frozenset("""convert_element_type dynamic_slice slice sharding_constraint reshape
broadcast_in_dim transpose squeeze expand_dims copy copy_p select_n concatenate pad iota
""".split())


@dataclass(frozen=True)
class PipelineSpec:
    """How a model runs as stages: ``pre(model, mb) -> x``, the blocks of the layer stack at
    attribute ``stack`` (leading ``layers`` axis), ``post(model, x, mb) -> loss | (loss, aux)``;
    ``remat`` is the model's per-block rematerialisation policy."""

    stack: str
    pre: Callable[[nnx.Module, dict], jax.Array]
    post: Callable[[nnx.Module, jax.Array, dict], Any]
    remat: str = "none"


# ---------------------------------------------------------------------------------------------
# The padded layout of the stacked blocks.


def to_stages(params: nnx.State, spec: PipelineSpec, split: StageSplit) -> nnx.State:
    """``params`` with every Variable of the stack in the padded ``[P, V·Lmax, ...]`` layout,
    named ``("stage", "layers", ...)`` and carrying its row map."""
    rows = split.rows  # [P, V·Lmax], -1 = padding
    index = np.where(rows >= 0, rows, 0)
    keep = rows >= 0
    rows_meta = tuple(int(i) for i in split.flat_index())

    def pad(v: nnx.Variable) -> nnx.Variable:
        names, _ = sharding.names_of(v)
        x = v[...]
        out = jnp.take(x, jnp.asarray(index), axis=0)
        out = jnp.where(jnp.asarray(keep).reshape(keep.shape + (1,) * (x.ndim - 1)), out, 0)
        new = ("stage",) + tuple(names or ("layers",) + (None,) * (x.ndim - 1))
        return v.replace(out.astype(x.dtype), out_sharding=new, **{ROWS_KEY: rows_meta})

    stack = jax.tree.map(pad, params[spec.stack], is_leaf=lambda x: isinstance(x, nnx.Variable))
    out = nnx.State(dict(params))
    out[spec.stack] = stack
    return out


def _split_params(params: nnx.State, stack: str) -> tuple[nnx.State, nnx.State]:
    return params[stack], nnx.State({k: v for k, v in params.items() if k != stack})


def _join(shared: nnx.State, stack_name: str, stack: Any) -> nnx.State:
    out = nnx.State(dict(shared))
    out[stack_name] = stack
    return out


# ---------------------------------------------------------------------------------------------
# The executor.


def _stash_policy(prim: Any, *_: Any, **__: Any) -> bool:
    """Keep what is expensive to recompute; casts, slices and reshapes are redone."""
    return prim.name not in _CHEAP


BLOCK_INPUT = "jaxmp_pipeline_block_input"


def stash_policy(remat: str) -> Callable:
    """What a chunk's forward keeps for its backward. Without remat: everything expensive. With
    a remat policy, that policy plus each block's input: an outer policy decides for the
    nested blocks too, so saving everything expensive here would undo the blocks' remat."""
    if remat == "none":
        return _stash_policy
    return jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.save_only_these_names(BLOCK_INPUT), REMAT_POLICIES[remat])


def make_pipeline_grad_fn(graphdef: Any, block_graphdef: Any, mesh: jax.sharding.Mesh,
                          spec: PipelineSpec, schedule: Schedule, split: StageSplit,
                          rules: Sequence) -> Callable:
    """``(params, rest, batch, key) -> (loss, grads, rest, aux)`` run as ``schedule``; the same
    contract as :func:`jaxmp.train.step.make_grad_fn` (token-weighted mean loss).

    ``graphdef`` is the whole model's, ``block_graphdef`` one block's (see
    :func:`block_graphdef`)."""
    p, v_per, m = schedule.stages, schedule.virtual, schedule.microbatches
    last = schedule.chunks - 1
    prog = schedule.program()
    tables = {k: jnp.asarray(getattr(prog, k)) for k in (
        "f_mb", "f_chunk", "f_act", "f_res", "b_mb", "b_chunk", "b_res", "b_act", "b_ct",
        "recv_act", "recv_ct")}
    counts = jnp.asarray(split.counts)  # [P, V]
    lmax = split.max_blocks

    def model_of(shared: nnx.State, chunk: Any, rest: Any) -> nnx.Module:
        return nnx.merge(graphdef, _join(shared, spec.stack, chunk), rest, copy=True)

    def run_blocks(chunk: Any, x: jax.Array, n: jax.Array) -> jax.Array:
        def body(h: jax.Array, xs: tuple) -> tuple[jax.Array, None]:
            i, layer = xs
            call = checkpointed(lambda h, layer: nnx.merge(block_graphdef, layer)(h), spec.remat)
            h = checkpoint_name(h, BLOCK_INPUT)
            return jax.lax.cond(i < n, call, lambda h, _: h, h, layer), None

        return jax.lax.scan(body, x, (jnp.arange(lmax), chunk))[0]

    def chunk_fn(with_post: bool) -> Callable:
        """``(shared, chunk, x, mb, rest, c, n) -> (y, weighted loss, weight)``."""

        def fn(shared, chunk, x, mb, rest, c, n):
            model = model_of(shared, chunk, rest)
            x = jax.lax.cond(c == 0, lambda: spec.pre(model, mb).astype(x.dtype), lambda: x)
            y = run_blocks(chunk, x, n)
            if not with_post:
                return y, jnp.float32(0), jnp.float32(0)

            def post():
                loss, aux = split_loss(spec.post(model, y, mb))
                w = jax.lax.stop_gradient(aux.get("weight", jnp.float32(1.0))).astype(jnp.float32)
                return loss.astype(jnp.float32) * w, w

            lw, w = jax.lax.cond(c == last, post, lambda: (jnp.float32(0), jnp.float32(0)))
            return y, lw, w

        return fn

    fwd = chunk_fn(with_post=not schedule.folds_last)
    policy = stash_policy(spec.remat)
    full = chunk_fn(with_post=True)

    def body(stack, shared, rest, batch):
        d = jax.lax.axis_index(STAGE)
        stack = jax.tree.map(lambda a: a.reshape((v_per, lmax) + a.shape[2:]), stack)
        chunk0 = jax.tree.map(lambda a: a[0], stack)
        mb0 = jax.tree.map(lambda a: a[0], batch)
        x_aval = jax.eval_shape(lambda: spec.pre(model_of(shared, chunk0, rest), mb0))
        zero_x = jnp.zeros(x_aval.shape, x_aval.dtype)

        def residuals(shared, chunk, x, mb, c, n):
            """Forward of one chunk: its outputs and the residuals worth keeping."""
            f = jax.checkpoint(lambda s, ch, x: fwd(s, ch, x, mb, rest, c, n), policy=policy)
            out, vjp = jax.vjp(f, shared, chunk, x)
            leaves, treedef = jax.tree.flatten(vjp)
            live = {id(a): i for i, a in enumerate(jax.tree.leaves((shared, chunk)))}
            kinds = tuple(live.get(id(a), -1) for a in leaves)
            return out, leaves, treedef, kinds

        box: dict[str, Any] = {}

        def shapes(*args):
            out, leaves, treedef, kinds = residuals(*args)
            box.update(treedef=treedef, kinds=kinds)
            return [a for a, k in zip(leaves, kinds) if k < 0]

        res_avals = jax.eval_shape(shapes, shared, chunk0, zero_x, mb0, jnp.int32(1),
                                   jnp.int32(1))
        res0 = [jnp.zeros((prog.res_slots + 1,) + a.shape, a.dtype) for a in res_avals]
        act0 = jnp.zeros((prog.act_slots + 1,) + zero_x.shape, zero_x.dtype)
        ct0 = jnp.zeros((prog.ct_slots + 1,) + zero_x.shape, zero_x.dtype)
        g_stack0 = jax.tree.map(jnp.zeros_like, stack)
        g_shared0 = jax.tree.map(jnp.zeros_like, shared)

        def slot(i: jax.Array, n_slots: int) -> jax.Array:
            return jnp.where(i >= 0, i, n_slots)  # -1 writes the spare last slot

        def tick(carry, t):
            act, res, ct, g_stack, g_shared, lw_sum, w_sum = carry
            row = {k: tab[t, d] for k, tab in tables.items()}

            def forward(state):
                act, res, lw_sum, w_sum = state
                v, c = row["f_chunk"], row["f_chunk"] * p + d
                chunk = jax.tree.map(lambda a: a[v], stack)
                mb = jax.tree.map(lambda a: a[row["f_mb"]], batch)
                x = act[slot(row["f_act"], prog.act_slots)]
                (y, lw, w), leaves, _, kinds = residuals(shared, chunk, x, mb, c, counts[d, v])
                if kinds != box["kinds"]:  # pragma: no cover - a tracing difference
                    raise RuntimeError("pipeline residuals differ between traces")
                kept = [a for a, k in zip(leaves, kinds) if k < 0]
                res = [r.at[row["f_res"]].set(a) for r, a in zip(res, kept)]
                return (act, res, lw_sum + lw, w_sum + w), y

            def no_forward(state):
                return state, zero_x

            (act, res, lw_sum, w_sum), y = jax.lax.cond(
                row["f_mb"] >= 0, forward, no_forward, (act, res, lw_sum, w_sum))

            def backward(state):
                res, g_stack, g_shared, lw_sum, w_sum = state
                v, c = row["b_chunk"], row["b_chunk"] * p + d
                chunk = jax.tree.map(lambda a: a[v], stack)
                mb = jax.tree.map(lambda a: a[row["b_mb"]], batch)
                n = counts[d, v]

                def folded():  # the last chunk's forward and backward in one go
                    x = act[slot(row["b_act"], prog.act_slots)]
                    (lw, w), (gs, gc, gx) = _value_and_grad(
                        lambda s, ch, x: full(s, ch, x, mb, rest, c, n)[1:], shared, chunk, x)
                    return gs, gc, gx, lw, w

                def stashed():
                    kept = iter(r[slot(row["b_res"], prog.res_slots)] for r in res)
                    live = jax.tree.leaves((shared, chunk))
                    leaves = [live[k] if k >= 0 else next(kept) for k in box["kinds"]]
                    vjp = jax.tree.unflatten(box["treedef"], leaves)
                    cty = jnp.where(c == last, 0, ct[slot(row["b_ct"], prog.ct_slots)])
                    seed = jnp.where(c == last, 1.0, 0.0).astype(jnp.float32)
                    gs, gc, gx = vjp((cty, seed, jnp.float32(0)))
                    return gs, gc, gx, jnp.float32(0), jnp.float32(0)

                if schedule.folds_last:
                    gs, gc, gx, lw, w = jax.lax.cond(c == last, folded, stashed)
                else:
                    gs, gc, gx, lw, w = stashed()
                g_stack = jax.tree.map(lambda g, x: g.at[v].add(x), g_stack, gc)
                g_shared = jax.tree.map(jnp.add, g_shared, gs)
                return (res, g_stack, g_shared, lw_sum + lw, w_sum + w), gx

            def no_backward(state):
                return state, zero_x

            (res, g_stack, g_shared, lw_sum, w_sum), gx = jax.lax.cond(
                row["b_mb"] >= 0, backward, no_backward, (res, g_stack, g_shared, lw_sum, w_sum))
            sent = jax.lax.ppermute(y, STAGE, [(i, (i + 1) % p) for i in range(p)])
            act = act.at[slot(row["recv_act"], prog.act_slots)].set(sent)
            back = jax.lax.ppermute(gx, STAGE, [(i, (i - 1) % p) for i in range(p)])
            ct = ct.at[slot(row["recv_ct"], prog.ct_slots)].set(back)
            return (act, res, ct, g_stack, g_shared, lw_sum, w_sum), None

        init = (act0, res0, ct0, g_stack0, g_shared0, jnp.float32(0), jnp.float32(0))
        (_, _, _, g_stack, g_shared, lw_sum, w_sum), _ = jax.lax.scan(
            tick, init, jnp.arange(prog.ticks))
        g_stack = jax.tree.map(lambda a: a.reshape((1, v_per * lmax) + a.shape[2:]), g_stack)
        g_shared = jax.lax.psum(g_shared, STAGE)
        return g_stack, g_shared, jax.lax.psum(lw_sum, STAGE), jax.lax.psum(w_sum, STAGE)

    def grad_fn(params: Any, rest: Any, batch: dict, key: jax.Array | None = None) -> tuple:
        del key  # the GPT's blocks draw no randomness; see docs/pipeline.md
        # The mesh as traced now: inside a data replica's shard_map (gradient compression)
        # the stage shard_map nests in it.
        run = jax.shard_map(body, mesh=sharding.current_mesh(mesh),
                            in_specs=(P(STAGE), P(), P(), P()),
                            out_specs=(P(STAGE), P(), P(), P()), axis_names={STAGE},
                            check_vma=False)
        stack, shared = _split_params(params, spec.stack)
        micro = jax.tree.map(lambda x: _microbatches(x, m, mesh, rules), batch)
        with sharding.activation_sharding(mesh, rules):
            g_stack, g_shared, lw_sum, w_sum = run(stack, shared, rest, micro)
        scale = 1.0 / jnp.maximum(w_sum, 1e-12)
        grads = jax.tree.map(lambda g: g * scale.astype(g.dtype),
                             _join(g_shared, spec.stack, g_stack))
        return lw_sum * scale, grads, rest, {}

    return grad_fn


def _value_and_grad(f: Callable, *args: Any) -> tuple:
    """``((lw, w), grads of lw w.r.t. args)`` for ``f(*args) -> (lw, w)``."""
    (lw, w), vjp = jax.vjp(f, *args)
    return (lw, w), vjp((jnp.float32(1), jnp.float32(0)))


def _microbatches(x: jax.Array, m: int, mesh: Any, rules: Sequence) -> jax.Array:
    """``[B, ...] -> [M, B/M, ...]``, microbatch j = rows j, j+M, ... (every batch shard works
    on every microbatch), its batch dim sharded by the ``batch`` rule."""
    mb = x.reshape((x.shape[0] // m, m) + x.shape[1:]).swapaxes(0, 1)
    with sharding.activation_sharding(mesh, rules):
        return sharding.constrain(mb, (None, "batch") + (None,) * (x.ndim - 1))


def _stack(model: nnx.Module, spec: PipelineSpec) -> nnx.Module:
    node = model
    for part in spec.stack.split("/"):
        node = getattr(node, part)
    return node


def block_graphdef(model: nnx.Module, spec: PipelineSpec) -> Any:
    """The graph of one block of ``model``'s layer stack (an abstract model will do)."""
    return nnx.split(_stack(model, spec))[0]


def stack_length(model: nnx.Module, spec: PipelineSpec | None) -> int:
    """Blocks in ``model``'s layer stack (0 without a spec)."""
    if spec is None:
        return 0
    leaves = jax.tree.leaves(nnx.state(_stack(model, spec), nnx.Param))
    return int(leaves[0].shape[0]) if leaves else 0
