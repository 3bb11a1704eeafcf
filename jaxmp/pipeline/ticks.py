"""One device's view of the pipeline's tick loop: its row of the schedule's tables
(:class:`TickInputs`), what it holds inside the ``shard_map`` (:class:`DeviceTicks`: its
chunks' weights gathered once per step, the shared params, its microbatches) and the ring it
sends on. The training and evaluation ticks of :mod:`jaxmp.pipeline.executor` build on it."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxmp import sharding
from jaxmp.pipeline.chunk import Chunk, leaf_names

STAGE = "stage"
FORWARD_TICK = "forward_tick"  # name scope of a tick's forward conditional
BACKWARD_TICK = "backward_tick"  # ... and of its backward one


class TickInputs(NamedTuple):
    """One device's row of the schedule's :class:`~jaxmp.pipeline.schedule.Program` at one tick
    (int32 scalars, -1: none). Chunks are local indices ``v``: global chunk ``v·P + device``."""

    forward_microbatch: Any
    forward_chunk: Any
    forward_input_slot: Any  # activation slot the forward reads (-1: chunk 0 reads the batch)
    forward_stash_slot: Any  # residual slot it fills
    backward_microbatch: Any
    backward_chunk: Any
    backward_stash_slot: Any  # residual slot the backward reads (-1: the fused last chunk)
    backward_input_slot: Any  # activation slot the fused last chunk reads
    backward_cotangent_slot: Any  # cotangent slot it reads (-1: the last chunk, seeded by loss)
    arriving_activation_slot: Any  # takes the activation device d - 1 sends after the tick
    arriving_cotangent_slot: Any  # takes the cotangent device d + 1 sends after the tick


PROGRAM_COLUMNS = TickInputs(*"""f_mb f_chunk f_act f_res b_mb b_chunk b_res b_act b_ct recv_act
recv_ct""".split())


def buffer_slot(index: jax.Array, slots: int) -> jax.Array:
    """A buffer index: -1 (nothing to read or keep) is the spare slot past the last."""
    return jnp.where(index >= 0, index, slots)


class DeviceTicks:
    """What one device holds inside the ``shard_map``, for training and evaluation alike
    (``executor``: the :class:`~jaxmp.pipeline.executor.PipelineExecutor`)."""

    def __init__(self, executor: Any, chunk: Chunk, stack: Any, shared: Any,
                 rest: Any, microbatches: dict):
        self.executor, self.chunk = executor, chunk
        self.stages, self.virtual = executor.schedule.stages, executor.schedule.virtual
        self.device = jax.lax.axis_index(STAGE)
        lmax = executor.split.max_blocks
        # Each stack leaf's logical names for one chunk's rows [Lmax, ...] (stored ("stage",
        # "layers", ...)): gradients are pinned to them, see `like_params`.
        self.chunk_names = [("layers",) + tuple(names)[2:] if names else None
                            for names in leaf_names(stack)]
        self.stack = resident(jax.tree.map(
            lambda a: a.reshape((self.virtual, lmax) + a.shape[2:]), stack),
            [(None,) + names if names else None for names in self.chunk_names])
        # The shared params (embedding, head) likewise: gathered inside the first / last
        # chunk's branches they moved on every microbatch, twice for the embedding (its
        # stashed backward recomputes the lookup), exposed (docs/planner.md §7, stop 27).
        self.shared_names = leaf_names(shared)
        self.shared = resident(shared, self.shared_names)
        # The token ids the first chunk looks up, gathered over fsdp here (outside the loop,
        # as the weights are) for the lookup's gradient (jaxmp.models.lookup).
        self.token_ids = executor.spec.token_ids
        self.rest, self.microbatches = rest, {
            k: sharding.gathered(v, (None, "batch", None)) if k in self.token_ids else v
            for k, v in microbatches.items()}
        activation = chunk.activation(self.params(0), self.microbatch(0), rest)
        self.zero_activation = jnp.zeros(activation.shape, activation.dtype)  # A

    def params(self, local_chunk: Any) -> tuple:
        """``(shared, the chunk's stack rows [Lmax, ...])``."""
        return self.shared, jax.tree.map(lambda a: a[local_chunk], self.stack)

    def like_params(self, chunk_tree: Any, lead: tuple = ()) -> Any:
        """``chunk_tree`` (shaped like one chunk's stack rows, after ``lead`` dims) constrained
        to the parameters' sharding. Without it, the partitioner leaves a weight gradient made
        inside a tick's ``lax.cond`` unsharded and all-reduces it over fsdp in full (GPU-
        compiled), instead of reduce-scattering it as the layer loop outside a pipeline does."""
        return pinned(chunk_tree, [(None,) * len(lead) + names if names else None
                                   for names in self.chunk_names])

    def like_shared(self, tree: Any) -> Any:
        """``tree`` (shaped like the shared params: their gradients) constrained to the
        shared params' sharding (see :meth:`like_params`)."""
        return pinned(tree, self.shared_names)

    def microbatch(self, index: Any) -> dict:
        """Microbatch ``index``; its token ids whole over fsdp (read from the copy gathered
        before the loop: pinned here too, or the partitioner gathers them in the tick)."""
        return {k: sharding.gathered(v[index], ("batch", None)) if k in self.token_ids
                else jax.tree.map(lambda a: a[index], v) for k, v in self.microbatches.items()}

    def global_chunk(self, local_chunk: Any) -> jax.Array:
        return local_chunk * self.stages + self.device

    def n_blocks(self, local_chunk: Any) -> jax.Array:
        return self.executor.blocks_per_chunk[self.device, local_chunk]

    def send(self, x: jax.Array, step: int) -> jax.Array:
        """``x`` from every device to device ``d + step`` (around the ring)."""
        return jax.lax.ppermute(x, STAGE, [(i, (i + step) % self.stages)
                                           for i in range(self.stages)])


def _per_leaf(tree: Any, names: list, apply: Any) -> Any:
    """``apply(leaf, names)`` on each leaf with names (None: left alone); a tree whose leaves
    do not match ``names`` one to one is returned as it is."""
    flat, treedef = jax.tree.flatten(tree)
    if len(flat) != len(names):
        return tree
    return treedef.unflatten([apply(x, n) if n else x for x, n in zip(flat, names)])


def pinned(tree: Any, names: list) -> Any:
    """``tree``'s leaves constrained to their logical ``names``."""
    return _per_leaf(tree, names, sharding.constrain)


def resident(tree: Any, names: list) -> Any:
    """Params gathered over fsdp once per step, before the tick loop: the device's stack rows
    ``[V, Lmax, ...]`` and the shared params, which every tick's forward and backward read.
    Gathered where a chunk runs, the weights would move inside the tick's ``lax.cond``, where
    XLA's scheduler overlaps no compute with them, on every tick that runs one (measured:
    docs/planner.md §7). Their gradients are pinned back to the params' names
    (:meth:`DeviceTicks.like_params`): reduce-scattered per microbatch. The memory this holds:
    :func:`jaxmp.plan.pipeline.resident_weight_bytes`."""
    return _per_leaf(tree, names, sharding.gathered)
