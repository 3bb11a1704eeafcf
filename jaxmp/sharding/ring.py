"""Collective matmuls over ``tensor``: sequence parallelism's gathers and reduce-scatters split
into a ring of neighbour sends, each hidden behind the matmul of the chunk already in hand.

With sequence parallelism (:mod:`jaxmp.sharding.sequence`) the residual stream arrives at a
column-parallel projection split along the sequence; the partitioner all-gathers it whole and
then multiplies. A row-parallel projection's partial sums are reduce-scattered after the
matmul. Either way the transfer and the matmul depend on each other, and XLA's GPU scheduler
finds no compute to run beside the collective (jaxmp's 175B-wide slice at tensor 4: 8 of 10
all-gathers, 6 of 9 reduce-scatters with no matmul between start and done). XLA's own
windowed einsum did not fire on jaxmp's program (docs/planner.md §7).

Here the same products run as ``tensor`` steps (Wang et al. 2022, "Overlap communication with
dependent computation via decomposition"): the *column* side multiplies the sequence block it
holds while the block is passed on to the next device (a ``ppermute``), and writes each
product at its block's place; the *row* side multiplies one block of its input and adds it to
the partial sum arriving from the previous device, so after ``tensor`` steps each device holds
the sum of its own block. Every send has a matmul that does not depend on it. The row side's backward is
autodiff's (the transpose of a ``ppermute`` is the reverse ``ppermute``: a column-side ring);
the column side's is its own (a custom VJP), so that its weight gradient passes the blocks
round again (the other way: XLA merges identical sends of the same array, autodiff's
recomputed ones with the forward's) instead of keeping all ``t`` of them.

The ring runs inside a ``shard_map`` over ``tensor`` only; the other mesh axes stay automatic
(data, fsdp gathers of the weights). Inside the pipeline's stages, outside :func:`activation_sharding`, without sequence
parallelism or where shapes do not divide, both functions are the plain call — under sequence
parallelism with the split stream gathered once for all the column side's matmuls
(:func:`gathered_once`) and the row side's output gradient once for both of its backward
matmuls.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxmp.mesh import manual_axes, shard_map_over
from jaxmp.sharding.activations import active, activation_sharding, constrain, splits
from jaxmp.sharding.resolve import resolve

AXIS = "tensor"
STAGE = "stage"  # the pipeline's manual axis (jaxmp.pipeline.executor)
SEQ_DIM = 1  # [batch, seq, ...] activations
GPU_PLATFORMS = ("gpu", "cuda", "rocm")
Names = Sequence[str | None]


def _enabled(setting: bool | str, mesh: Any) -> bool:
    """``setting`` resolved for ``mesh``: "auto" is on where the mesh's devices are GPUs
    (where XLA's scheduler overlaps a send with a matmul; a CPU runs them in turn)."""
    if setting == "auto":
        devices = getattr(mesh, "devices", None)
        first = np.asarray(devices).flat[0] if devices is not None else None
        return str(getattr(first, "platform", "")).lower() in GPU_PLATFORMS
    return bool(setting)


def _tensor_spec(names: Names, shape: Sequence[int], sizes: dict[str, int], rules: Any) -> P:
    """The part of ``names``' sharding that is over ``tensor`` (the shard_map's manual axis)."""
    spec = resolve(tuple(names), tuple(shape), sizes, rules).spec
    entries = [e if isinstance(e, tuple) else (e,) if e else () for e in spec]
    entries += [()] * (len(shape) - len(entries))
    return P(*(AXIS if AXIS in e else None for e in entries))


def _ring(setting: bool | str, x: Any, weights: Sequence[Any], x_names: Names,
          weight_names: Sequence[Names], out_names: Sequence[Names], out_shapes: Sequence[Any],
          column: bool) -> tuple[Any, int, tuple[P, ...], tuple[P, ...]] | None:
    """(mesh, tensor size, in specs, out specs) where the ring applies, else None."""
    found = active()
    if found is None:
        return None
    mesh, rules = found
    if not _enabled(setting, mesh):
        return None
    if STAGE in manual_axes(mesh):
        # inside the pipeline's stage shard_map a ppermute over tensor is ONE collective whose
        # source-target pairs span every stage's devices, and the executor runs a stage's
        # blocks inside its tick conditionals, which the idle stages skip: XLA:CPU's
        # rendezvous waits for all 8 devices and 4 arrive (stage 2 x data 2 x tensor 2,
        # stop 30: a deadlock, then an abort). Pipelined stages keep the partitioner's
        # collectives (grouped per stage). (A data replica's shard_map, the reducer's, is
        # fine: tested.)
        return None
    t = int(dict(mesh.shape).get(AXIS, 1))
    if t <= 1 or x.shape[SEQ_DIM] % t:
        return None
    sizes = {a: (int(n) if a == AXIS else 1) for a, n in dict(mesh.shape).items()}
    x_spec = _tensor_spec(x_names, x.shape, sizes, rules)
    w_specs = [_tensor_spec(n, w.shape, sizes, rules) for n, w in zip(weight_names, weights,
                                                                       strict=True)]
    o_specs = [_tensor_spec(n, s.shape, sizes, rules) for n, s in zip(out_names, out_shapes,
                                                                       strict=True)]
    split = (x_spec[SEQ_DIM] == AXIS) if column else all(s[SEQ_DIM] == AXIS for s in o_specs)
    whole = all(s[SEQ_DIM] is None for s in o_specs) if column else x_spec[SEQ_DIM] is None
    if not (split and whole):  # no sequence parallelism here: nothing to overlap
        return None
    return mesh, t, (x_spec, *w_specs), tuple(o_specs)


def _neighbour(t: int, step: int = 1) -> list[tuple[int, int]]:
    return [(j, (j + step) % t) for j in range(t)]


def column_matmul(fn: Callable[..., tuple[Any, ...]], x: Any, weights: Sequence[Any],
                  x_names: Names, weight_names: Sequence[Names], out_names: Sequence[Names],
                  setting: bool | str = "auto") -> tuple[Any, ...]:
    """``fn(x, *weights)`` (a tuple of ``[batch, seq, ...]`` arrays, each row of the sequence
    computed from the same row of ``x``) with ``x`` sequence-split over ``tensor``: the
    all-gather of ``x`` as a ring of sends beside the per-block matmuls."""
    out_shapes = jax.eval_shape(fn, x, *weights)
    ring = _ring(setting, x, weights, x_names, weight_names, out_names, out_shapes, True)
    if ring is None:
        return fn(gathered_once(x, x_names), *weights)
    mesh, t, in_specs, out_specs = ring

    def forward(chunk: Any, *ws: Any) -> tuple[Any, ...]:
        i, n = lax.axis_index(AXIS), chunk.shape[SEQ_DIM]
        outs = None
        for k in range(t):  # step k holds the block of device i - k
            parts = fn(chunk, *ws)
            if outs is None:
                outs = [lax.full((*p.shape[:SEQ_DIM], n * t, *p.shape[SEQ_DIM + 1:]), 0, p.dtype)
                        for p in parts]
            outs = [lax.dynamic_update_slice_in_dim(o, p, ((i - k) % t) * n, SEQ_DIM)
                    for o, p in zip(outs, parts, strict=True)]
            if k < t - 1:
                chunk = lax.ppermute(chunk, AXIS, _neighbour(t))
        return tuple(outs)

    def backward(saved: tuple, grads: tuple) -> tuple:
        # The weight gradient needs every block again: passed round the ring once more
        # (beside the input gradient's matmuls) rather than kept from the forward — t blocks
        # per input, the memory sequence parallelism saves — and gathered whole, as sequence
        # parallelism re-gathers it, for ONE weight-gradient matmul: one per block left every
        # block's gradient live at once and the partitioner reduce-scattered each over fsdp
        # (Llama-3-70B's width, fsdp 8 x tensor 8: 16 of [3584, 8192] live, the weight
        # gradients' fsdp bytes x t). The input gradient is a row-side ring of its own.
        chunk, ws = saved
        i, n = lax.axis_index(AXIS), chunk.shape[SEQ_DIM]
        block = lambda b: tuple(lax.dynamic_slice_in_dim(g, b * n, n, SEQ_DIM) for g in grads)
        _, of_input = jax.vjp(lambda c: fn(c, *ws), chunk)  # linear in the block
        whole = lax.full((*chunk.shape[:SEQ_DIM], n * t, *chunk.shape[SEQ_DIM + 1:]), 0,
                         chunk.dtype)
        acc = None
        for k in range(t):  # chunk holds the block of device i + k
            whole = lax.dynamic_update_slice_in_dim(whole, chunk, ((i + k) % t) * n, SEQ_DIM)
            part = of_input(block((i - 1 - k) % t))[0]
            acc = part if acc is None else lax.ppermute(acc, AXIS, _neighbour(t)) + part
            if k < t - 1:  # the other way round: XLA would merge the forward's sends
                chunk = lax.ppermute(chunk, AXIS, _neighbour(t, -1))
        _, of_weights = jax.vjp(lambda *w: fn(whole, *w), *ws)
        return (acc, *of_weights(grads))

    local = jax.custom_vjp(forward)
    local.defvjp(lambda chunk, *ws: (forward(chunk, *ws), (chunk, ws)), backward)
    return tuple(shard_map_over(local, mesh, {AXIS}, in_specs, out_specs)(x, *weights))


def _once(x: Any, names: Names) -> bool:
    """Whether :func:`gathered_once` gathers ``x``: its sequence is split (sequence
    parallelism) on a GPU mesh."""
    found = active()
    return (found is not None and _enabled("auto", found[0])
            and splits(np.shape(x), names, SEQ_DIM))


def gathered_once(x: Any, names: Names) -> Any:
    """``x`` with its sequence gathered whole, once, where the active rules split it (sequence
    parallelism), else ``x``. Left to the partitioner, each matmul reading the split ``x``
    gets an all-gather of its own: XLA's GPU compiler then sends q's, k's and v's copies of
    the same input, forward and (for their weight gradients) backward — a 530B-wide slice at
    tensor 8 sent 32.9 GB per step for 21.7 predicted (docs/planner.md §7, stop 35). A
    constraint's output is not a saved residual (:func:`jaxmp.remat.keeps_all_but_constraints`),
    so the backward gathers the split input again, once, and reduce-scatters the summed
    input gradient once. On GPU meshes only: XLA:CPU sends no regathers (it keeps the
    gathered input), which its planner profile models (``reassociates_all_reduce``)."""
    if not _once(x, names):
        return x
    whole = list(names)
    whole[SEQ_DIM] = None
    # pinned split first: the saved input (what the backward gathers again) keeps the split
    # (without it the partitioner stored the gathered copy, t times the bytes)
    return constrain(constrain(x, names), whole)


def _cotangent_gathered_once(y: Any, names: Names) -> Any:
    """``y``, whose gradient is gathered whole once (:func:`gathered_once`) where the active
    rules split ``names``' sequence: the row matmul's input gradient and weight gradient both
    read it, and left to the partitioner each got an all-gather of its own."""
    found = active()
    if not _once(y, names):
        return y

    @jax.custom_vjp
    def same(a: Any) -> Any:
        return a

    def backward(_: None, g: Any) -> tuple[Any]:
        with activation_sharding(*found):
            return (gathered_once(g, names),)

    same.defvjp(lambda a: (a, None), backward)
    return same(y)


def row_matmul(fn: Callable[..., Any], h: Any, weights: Sequence[Any], h_names: Names,
               weight_names: Sequence[Names], out_names: Names,
               setting: bool | str = "auto") -> Any:
    """``fn(h, *weights)`` (a ``[batch, seq, ...]`` array, each row of the sequence from the
    same row of ``h``), contracted over a ``tensor``-split dim and wanted sequence-split over
    ``tensor``: the reduce-scatter as a ring of partial sums, one block's matmul beside each
    send."""
    out_shape = jax.eval_shape(fn, h, *weights)
    ring = _ring(setting, h, weights, h_names, weight_names, [out_names], [out_shape], False)
    if ring is None:
        return _cotangent_gathered_once(fn(h, *weights), out_names)
    mesh, t, in_specs, out_specs = ring

    def local(whole: Any, *ws: Any) -> Any:
        i = lax.axis_index(AXIS)
        n = whole.shape[SEQ_DIM] // t
        acc = None
        for k in range(t):  # this step's sum lands, t - 1 - k sends later, on block's owner
            block = lax.dynamic_slice_in_dim(whole, ((i - 1 - k) % t) * n, n, SEQ_DIM)
            part = fn(block, *ws)
            acc = part if acc is None else lax.ppermute(acc, AXIS, _neighbour(t)) + part
        return acc

    return shard_map_over(local, mesh, {AXIS}, in_specs, out_specs[0])(h, *weights)
