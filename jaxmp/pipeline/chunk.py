"""A model as pipeline chunks: the stage description a model provides, its layer stack in the
padded stage layout, and what one device computes for one (microbatch, chunk).

A model is pipelined as ``pre`` (e.g. the embedding) → the blocks of a stacked layer module →
``post`` (e.g. the head and the loss): a :class:`PipelineSpec`, from the recipe. Chunk ``c`` holds
some of the blocks (:mod:`jaxmp.pipeline.stages`); the first chunk also runs ``pre``, the last
one ``post``. :class:`Chunk` is that computation; the executor (:mod:`jaxmp.pipeline.executor`)
decides when each runs.

Shapes: ``P`` stages, ``V`` chunks per device, ``Lmax`` padded block rows per chunk. A stacked
block parameter is stored ``[P, V·Lmax, ...]`` (:func:`to_stages`); one chunk's parameters are
``[Lmax, ...]``, of which the first ``n_blocks`` rows are real — padding rows are skipped with
``lax.cond``, never computed.

The conditionals that run only on one chunk (``pre`` on the first, the loss on the last) are
named :data:`FIRST_CHUNK` / :data:`LAST_CHUNK` (their HLO ``op_name`` holds it): a static
count of the compiled program charges them on the ticks of that chunk only
(:func:`jaxmp.hlo.branches.one_branch_bytes`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxmp import sharding
from jaxmp.loss import split_loss
from jaxmp.pipeline.residuals import BLOCK_INPUT
from jaxmp.pipeline.stages import StageSplit
from jaxmp.remat import stashed
from jaxmp.sharding.tree import ROWS_KEY

FIRST_CHUNK = "first_chunk"  # name scope of the conditionals that run on chunk 0 only
LAST_CHUNK = "last_chunk"  # ... and on the last chunk only


@dataclass(frozen=True)
class PipelineSpec:
    """How a model runs as stages: ``pre(model, mb) -> x``, the blocks of the layer stack at
    attribute ``stack`` (leading ``layers`` axis), ``post(model, x, mb) -> loss | (loss, aux)``;
    ``remat`` is the model's per-block rematerialisation policy; ``token_ids`` the microbatch
    keys ``pre`` looks up in a table: the executor gathers them over fsdp once per step, before
    the tick loop, so the lookup's gradient reads them without a gather inside a tick
    (:mod:`jaxmp.models.lookup`)."""

    stack: str
    pre: Callable[[nnx.Module, dict], jax.Array]
    post: Callable[[nnx.Module, jax.Array, dict], Any]
    remat: str = "none"
    token_ids: tuple[str, ...] = ()


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


def leaf_names(tree: Any) -> list:
    """The logical names of each array leaf of a tree of NNX Variables (None where unnamed or
    not a Variable), in ``jax.tree.leaves`` order."""
    out: list = []
    for leaf in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, nnx.Variable)):
        names = sharding.names_of(leaf)[0] if isinstance(leaf, nnx.Variable) else None
        out.extend([names] * len(jax.tree.leaves(leaf)))
    return out


def split_stack(params: nnx.State, stack: str) -> tuple[Any, nnx.State]:
    """``(the stacked blocks' params, every other param)``."""
    return params[stack], nnx.State({k: v for k, v in params.items() if k != stack})


def join_stack(shared: nnx.State, stack_name: str, stack: Any) -> nnx.State:
    """The inverse of :func:`split_stack`."""
    out = nnx.State(dict(shared))
    out[stack_name] = stack
    return out


def _stack(model: nnx.Module, spec: PipelineSpec) -> nnx.Module:
    node = model
    for part in spec.stack.split("/"):
        node = getattr(node, part)
    return node


def block_graphdef(model: nnx.Module, spec: PipelineSpec) -> Any:
    """The graph of one block of ``model``'s layer stack (an abstract model will do)."""
    return nnx.graphdef(_stack(model, spec))


def stack_length(model: nnx.Module, spec: PipelineSpec | None) -> int:
    """Blocks in ``model``'s layer stack (0 without a spec)."""
    if spec is None:
        return 0
    leaves = jax.tree.leaves(nnx.state(_stack(model, spec), nnx.Param))
    return int(leaves[0].shape[0]) if leaves else 0


class Chunk:
    """One chunk of the model as a device runs it: ``pre`` on chunk 0, its blocks, and on the
    last chunk the loss. ``train=False`` runs the model in evaluation mode (``model.eval()``:
    dropout off), as the plain evaluation step does.

    ``params`` is ``(shared, chunk_params)``: every non-stack parameter (embedding, head, ...)
    and this chunk's rows of the stack, ``[Lmax, ...]`` each.
    """

    def __init__(self, graphdef: Any, spec: PipelineSpec, max_blocks: int, last_chunk: int,
                 train: bool = True, padded: bool = True):
        self.graphdef, self.spec = graphdef, spec
        self.max_blocks, self.last_chunk, self.train = max_blocks, last_chunk, train
        self.padded = padded  # some chunk has fewer than max_blocks blocks

    def model(self, params: tuple, rest: Any) -> nnx.Module:
        """The whole model with this chunk's rows as its stack (only they are ever run)."""
        shared, chunk_params = params
        model = nnx.merge(self.graphdef, join_stack(shared, self.spec.stack, chunk_params), rest,
                          copy=True)
        if not self.train:
            model.eval()
        return model

    def blocks(self, model: nnx.Module, chunk_params: Any, x: jax.Array,
               n_blocks: jax.Array) -> jax.Array:
        """``x -> y``, both ``[rows, ...]`` (an activation: ``[rows, seq, embed]`` for the GPT),
        through the first ``n_blocks`` of the ``Lmax`` rows; each block under the spec's remat
        policy, its input named :data:`~jaxmp.pipeline.residuals.BLOCK_INPUT`. Without remat,
        each block under the stash's policy (:func:`jaxmp.remat.stash_keeps`): what it does not
        keep is recomputed in that block's backward step, not for the whole chunk at once.

        Padding rows (only where some chunk has fewer blocks: ``padded``) are skipped with a
        ``lax.cond``. Without padding there is none: a stashed chunk's backward re-runs its
        forward scan under the stash's checkpoint, and through a ``cond`` every kept residual
        came out as a fresh copy, restacked beside the slot it was read from (GPU-compiled,
        stage 2 x fsdp 4: 16 MiB of a 2-block chunk, docs/planner.md §7 "Stop 29")."""
        graph = block_graphdef(model, self.spec)  # in the model's mode (train / eval)
        block = lambda h, layer: nnx.merge(graph, layer)(h)  # noqa: E731
        run = stashed(block, self.spec.remat, prevent_cse=False)

        def body(h: jax.Array, row: tuple) -> tuple[jax.Array, None]:
            index, layer = row
            h = checkpoint_name(h, BLOCK_INPUT)
            if not self.padded:
                return run(h, layer), None
            return jax.lax.cond(index < n_blocks, run, lambda h, _: h, h, layer), None

        return jax.lax.scan(body, x, (jnp.arange(self.max_blocks), chunk_params))[0]

    def loss(self, model: nnx.Module, y: jax.Array, microbatch: dict) -> tuple:
        """``(loss · weight, weight)`` of the last chunk's output, float32 scalars; ``weight``
        is the loss's ``aux["weight"]`` (token count), 1 without one."""
        loss, aux = split_loss(self.spec.post(model, y, microbatch))
        weight = jax.lax.stop_gradient(aux.get("weight", jnp.float32(1.0))).astype(jnp.float32)
        return loss.astype(jnp.float32) * weight, weight

    def forward(self, params: tuple, x: jax.Array, microbatch: dict, rest: Any,
                chunk: jax.Array, n_blocks: jax.Array, with_loss: bool = True) -> tuple:
        """``(y, loss · weight, weight)`` of global chunk ``chunk`` on ``x`` (``[rows, ...]``;
        chunk 0 reads the microbatch through ``pre`` instead). The loss terms are zero except
        on the last chunk, and always zero with ``with_loss=False``."""
        model = self.model(params, rest)
        with jax.named_scope(FIRST_CHUNK):
            x = jax.lax.cond(chunk == 0,
                             lambda: self.spec.pre(model, microbatch).astype(x.dtype), lambda: x)
        y = self.blocks(model, params[1], x, n_blocks)
        zero = (jnp.float32(0), jnp.float32(0))
        if not with_loss:
            return y, *zero
        with jax.named_scope(LAST_CHUNK):
            return y, *jax.lax.cond(chunk == self.last_chunk,
                                    lambda: self.loss(model, y, microbatch), lambda: zero)

    def activation(self, params: tuple, microbatch: dict, rest: Any) -> jax.ShapeDtypeStruct:
        """Shape and dtype of what ``pre`` hands the first block, per microbatch."""
        return jax.eval_shape(lambda: self.spec.pre(self.model(params, rest), microbatch))
