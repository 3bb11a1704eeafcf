"""Per-layer cost of any Flax NNX model: FLOPs, parameter, optimizer and activation bytes.

The planner derives meshes and pipeline stages from these numbers, so they are *measured* from
the traced training program, not from a formula of our GPT: the model's layers are found and
scoped (:mod:`jaxmp.cost.trace`), every equation of ``value_and_grad(loss)`` is counted
(:mod:`jaxmp.cost.flops`), and each distinct layer is traced alone to get its forward and
backward FLOPs and the activations its backward pass keeps under each remat policy.

Costs are for the *global* batch the model was traced with. Per device they scale with the rows
a device processes: FLOPs linearly, saved activations as ``constant + per_row * rows`` (each
residual knows which of its dims is the batch, found by tracing again with one row).

Code outside every layer is split into a ``pre`` layer (the embedding) and a ``post`` layer
(head and loss) by program order; root parameters go to whichever of the two reads them (both,
for tied embeddings).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxmp import sharding
from jaxmp._util.arrays import nbytes as _nbytes
from jaxmp._util.fmt import fmt_bytes, fmt_flops, table
from jaxmp.cost import flops as F
from jaxmp.cost.fusion import kept_values
from jaxmp.cost.layer import Saved, analyse_layer, carried_input_bytes, saved_from, with_rows
from jaxmp.cost.traffic import LinearTraffic, linear
from jaxmp.cost.traffic import count as count_traffic
from jaxmp.cost.trace import root_residuals, scope_index, trace_residuals, trace_training
from jaxmp.remat import REMAT_POLICIES

__all__ = ["LayerCost", "ModelCost", "model_costs"]


@dataclass
class LayerCost:
    """One layer's cost at the traced (global) batch; ``share`` of ``params`` is its own."""

    name: str
    kind: str  # "pre" | "layer" | "block" | "post"
    fwd_flops: float
    bwd_flops: float
    transcendentals: float
    recompute_flops: dict[str, float]
    saved: dict[str, Saved]
    params: tuple[sharding.Leaf, ...]
    share: float
    param_count: float
    param_bytes: float
    optimizer_bytes: float
    boundary_bytes: float  # output activations (what a pipeline stage would send on)
    input_bytes: float = 0.0  # float input activations
    act_itemsize: int = 4  # bytes per element of its float activations
    in_loop: bool = False  # runs inside a loop (a scanned layer stack)
    group: str = ""  # layers of one group (the blocks of a stack) have identical costs
    # What stays alive when the compiler fuses elementwise chains and recomputes them (the
    # layer outside a loop); ``saved`` is what a scan materialises. Default: same as saved.
    fused: dict[str, Saved] = field(default_factory=dict)
    # Live values of the layer's backward pass beyond its saved activations and parameter
    # gradients, per remat policy (their peak: the working set). Empty: unknown.
    transient: dict[str, Any] = field(default_factory=dict)
    # Per remat policy, the layer's forward pass as a loop body (a Timeline: what it holds
    # beside the stacks, jaxmp.plan.forward). Empty: unknown.
    forward: dict[str, Any] = field(default_factory=dict)
    # Per remat policy, the FLOPs counted in ``flops`` that fused kernels skip (causal masks).
    skipped_flops: dict[str, float] = field(default_factory=dict)
    # What a pipeline's stash keeps of it, per remat policy, where that differs from ``saved``
    # (without remat: :func:`jaxmp.remat.stash_keeps`). Empty: as ``saved``.
    staged: dict[str, Saved] = field(default_factory=dict)
    # Per remat policy, the memory traffic of its memory-bound work (jaxmp.cost.traffic):
    # fusions' bytes and thin matmuls' operands. Empty: not counted.
    traffic: dict[str, LinearTraffic] = field(default_factory=dict)

    def flops(self, remat: str = "none") -> float:
        """Training FLOPs (forward, backward, recomputation) at the traced batch."""
        return self.fwd_flops + self.bwd_flops + self.recompute_flops.get(remat, 0.0)

    def run_flops(self, remat: str = "none") -> float:
        """:meth:`flops` less what fused kernels skip (a causal attention's masked half):
        the work the device runs, which its time is charged for."""
        return self.flops(remat) - self.skipped_flops.get(remat, 0.0)

    def largest_value(self, rows: float, divisor: Callable, upcast_16bit: bool) -> float:
        """The largest batch-sized value it keeps for its backward (without remat) at
        ``rows``, divided by ``divisor(shape, batch_dim)``, in its activation dtype (a head's:
        its logits, whose gradient has their shape and the logits' dtype even where the loss
        keeps a float32 copy)."""
        saved = self.saved.get("none")
        if saved is None:
            return 0.0
        item = 4 if upcast_16bit and self.act_itemsize == 2 else self.act_itemsize
        return max((math.prod(shape) * item / divisor(shape, bdim, saved.names_of(k))
                    * rows / saved.rows
                    for k, (shape, bdim) in enumerate(zip(saved.shapes, saved.batch_dims))
                    if bdim is not None), default=0.0)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "fwd_flops": self.fwd_flops,
                "bwd_flops": self.bwd_flops, "param_count": self.param_count,
                "param_bytes": self.param_bytes, "optimizer_bytes": self.optimizer_bytes,
                "saved_bytes": {k: v.bytes for k, v in self.saved.items()},
                "recompute_flops": self.recompute_flops, "boundary_bytes": self.boundary_bytes,
                "input_bytes": self.input_bytes, "group": self.group or self.name}


@dataclass
class ModelCost:
    """Every layer in execution order, plus the whole traced program's own totals."""

    layers: list[LayerCost]
    rows: int  # global batch rows the costs are for
    batch_bytes: float  # the batch itself (an argument of the step)
    program_fwd_flops: float  # the model as configured (its own remat included)
    program_bwd_flops: float
    warnings: list[str] = field(default_factory=list)
    probes: dict[str, tuple[Callable, Callable, tuple]] = field(default_factory=dict, repr=False)
    runs_as: str = "none"  # the remat policy the model runs with as written (what is runnable)
    # The logical names its activations are constrained with, and the batch's sequence length
    # (its second dim): whether and how far sequence parallelism can split the model.
    activation_names: frozenset[str] = frozenset()
    seq_len: int = 0
    # Its blocks' tensor-parallel projections run as ring collective matmuls under sequence
    # parallelism (jaxmp.sharding.ring): True, False, or "auto" (where the backend overlaps).
    tensor_rings: bool | str = False
    # Its "pre" layer is an embedding lookup whose gradient is scattered into the table's own
    # fsdp shards after an all-to-all of the stream's gradient (jaxmp.models.lookup).
    sharded_lookup: bool = False

    def flops_per_step(self, remat: str = "none") -> float:
        return sum(layer.flops(remat) for layer in self.layers)

    @property
    def param_count(self) -> float:
        return sum(layer.param_count for layer in self.layers if layer.kind != "post"
                   ) + sum(layer.param_count for layer in self.layers
                           if layer.kind == "post" and not _shared_with_pre(self, layer))

    def table(self, remat: str = "none") -> str:
        """A per-layer table: FLOPs, parameters, saved activations, boundary activations."""
        rows = [[lay.name, fmt_flops(lay.fwd_flops), fmt_flops(lay.bwd_flops),
                 f"{lay.param_count:,.0f}", fmt_bytes(lay.saved[remat].bytes),
                 fmt_bytes(lay.boundary_bytes)] for lay in self.layers]
        rows.append(["total", fmt_flops(sum(x.fwd_flops for x in self.layers)),
                     fmt_flops(sum(x.bwd_flops for x in self.layers)), f"{self.param_count:,.0f}",
                     fmt_bytes(sum(x.saved[remat].bytes for x in self.layers)), ""])
        return "\n".join(table(["layer", "forward", "backward", "params", "saved", "output"],
                               rows, right={1, 2, 3, 4, 5}, indent=""))


def _shared_with_pre(cost: ModelCost, post: LayerCost) -> bool:
    pre = {leaf.path for lay in cost.layers if lay.kind == "pre" for leaf in lay.params}
    return bool(pre) and all(leaf.path in pre for leaf in post.params)


def _abstract(tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(tuple(np.shape(x)), jnp.result_type(x)),
                        tree)


def _itemsize(tree: Any) -> int:
    sizes = [jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)
             if isinstance(x, jax.ShapeDtypeStruct) and jnp.issubdtype(x.dtype, jnp.inexact)]
    return min(sizes) if sizes else 4


def _float_bytes(tree: Any) -> float:
    return float(sum(_nbytes(x) for x in jax.tree.leaves(tree) if isinstance(
        x, jax.ShapeDtypeStruct) and jnp.issubdtype(x.dtype, jnp.inexact)))


def _leaf_aval(leaf: sharding.Leaf) -> jax.ShapeDtypeStruct:
    item = leaf.nbytes // max(1, math.prod(leaf.shape))
    dtype = {2: jnp.bfloat16, 8: jnp.float64}.get(item, jnp.float32)
    return jax.ShapeDtypeStruct(leaf.shape, dtype)


# ---------------------------------------------------------------------------------------------
# The whole model.


def _attribute(grad_jaxpr: Any, n_params: int) -> dict[str, Any]:
    """Every equation of the training program to a layer (or the root), forward or backward.

    Root code before the first layer's forward (after its last backward) is ``pre``, the rest
    ``post``; the root parameters each side reads are collected through the tags.
    """
    tags = {v: frozenset([i]) for i, v in enumerate(grad_jaxpr.jaxpr.invars[:n_params])}
    warnings: list[str] = []
    leaf_eqns = list(F.iter_eqns(grad_jaxpr, warnings=warnings, tags=tags))
    where = [scope_index(x.name_stack) for x in leaf_eqns]
    back = [F.is_backward(x.name_stack) for x in leaf_eqns]
    order: list[int] = []
    for w, b in zip(where, back):
        if w is not None and not b and w not in order:
            order.append(w)
    fwd_idx = [i for i, (w, b) in enumerate(zip(where, back)) if w is not None and not b]
    bwd_idx = [i for i, (w, b) in enumerate(zip(where, back)) if w is not None and b]
    root = {k: F.Counts() for k in ("pre_f", "pre_b", "post_f", "post_b")}
    root_reads: dict[str, set[int]] = {"pre": set(), "post": set()}
    prog_f, prog_b = F.Counts(), F.Counts()
    for i, (leaf, w, b) in enumerate(zip(leaf_eqns, where, back)):
        c = leaf.counts.scaled(leaf.multiplier)
        (prog_b if b else prog_f).__iadd__(c)
        if w is not None:
            continue
        if b:
            side = "pre" if bwd_idx and i > bwd_idx[-1] else "post"
        else:
            side = "pre" if not fwd_idx or i < fwd_idx[0] else "post"
            root_reads[side].update(leaf.reads)
        root[f"{side}_{'b' if b else 'f'}"] += c
    looped = {w for w, x in zip(where, leaf_eqns) if w is not None and x.multiplier > 1}
    return {"order": order, "looped": looped, "root": root, "root_reads": root_reads,
            "program_fwd": prog_f, "program_bwd": prog_b, "warnings": warnings}


def _root_saved(model: Any, batch: Any, loss_fn: Callable | None, rows: int
                ) -> tuple[dict[str, tuple[list, list]], dict[str, tuple[list, list]], Any]:
    """Activations the root code keeps for the backward pass, ``pre`` and ``post``, traced at
    the batch and at one row (constant ones are parameter slices or casts: not counted): as
    the VJP keeps them, and the anchors that survive fusion (:mod:`jaxmp.cost.fusion`; traced
    flat, jitted helpers inlined). E.g. a GPT's head keeps its float32 logits and the one-hot
    of the targets for the backward; compiled, only the matmul's bfloat16 logits stay."""
    res_jaxpr = trace_residuals(model, batch, loss_fn)
    res_one = trace_residuals(model, with_rows(batch, rows, 1), loss_fn) if rows > 1 else None
    saved: dict[str, tuple[list, list]] = {"pre": ([], []), "post": ([], [])}
    one_by_idx = {idx: aval for aval, _, idx in root_residuals(res_one)} if res_one else {}
    for aval, side, idx in root_residuals(res_jaxpr):
        if res_one is not None and one_by_idx.get(idx, aval).shape == aval.shape:
            continue
        saved[side][0].append(aval)
        saved[side][1].append(one_by_idx.get(idx, aval))
    with jax.disable_jit():
        flat = [trace_residuals(model, b, loss_fn) for b in
                ((batch, with_rows(batch, rows, 1)) if rows > 1 else (batch,))]
    anchors = [{side: [v.aval for v in kept_values(
        j, [j.jaxpr.outvars[idx] for _, s, idx in root_residuals(j) if s == side],
        exclude=j.jaxpr.invars)] for side in ("pre", "post")} for j in flat]
    fused: dict[str, tuple[list, list]] = {"pre": ([], []), "post": ([], [])}
    for side in fused:
        full, one = anchors[0][side], anchors[-1][side]
        if len(full) != len(one):  # the two traces differ: keep the unfused residuals
            fused[side] = saved[side]
            continue
        for a, b in zip(full, one):
            if rows == 1 or a.shape != b.shape:
                fused[side][0].append(a)
                fused[side][1].append(b)
    return saved, fused, res_one


def _root_traffic(model: Any, batch: Any, loss_fn: Callable | None, rows: int
                  ) -> LinearTraffic:
    """The memory traffic of the code outside the layers (embedding, final norm, head, loss:
    a GPT's log-softmax over its vocabulary), forward and backward, charged to ``post``."""
    def one(b: Any) -> Any:
        jaxpr, _ = trace_training(model, b, loss_fn)
        n = len(jaxpr.jaxpr.invars) - len(jax.tree.leaves(b))
        return count_traffic(jaxpr, jaxpr.jaxpr.invars[:n],
                             where=lambda stack: scope_index(stack) is None)

    return linear(one(batch), one(with_rows(batch, rows, 1)) if rows > 1 else None, rows)


def model_costs(model: Any, batch: Any, loss_fn: Callable | None = None,
                tx: Any = None, policies: Sequence[str] = tuple(REMAT_POLICIES),
                path_rules: Sequence | None = None, root_model: Any = None) -> ModelCost:
    """Per-layer costs of ``model`` (an NNX module or ``model_fn(rngs)``) on ``batch``.

    ``batch`` is a pytree of arrays or ``jax.ShapeDtypeStruct`` whose leading dim is the global
    batch; ``loss_fn(model, batch[, rngs])`` returns the loss (default: the sum of the outputs
    of ``model(batch)``); ``tx`` sizes optimizer state (default: two moments per parameter,
    Adam); ``path_rules`` name parameters that carry no metadata, as in the Trainer.
    Nothing is executed or compiled: everything is traced on abstract values.
    ``root_model``: the same model with fewer layers (its code outside the layers identical),
    traced for the root's residuals instead: that trace runs with jit off, which unrolls
    every loop, so a deep scanned stack would cost its depth there for nothing.
    """
    if not isinstance(model, nnx.Module):
        model = sharding.abstract(lambda: model(nnx.Rngs(0)))
    batch = _abstract(batch)
    rows = int(jax.tree.leaves(batch)[0].shape[0])
    with sharding.recording_names() as names:
        grad_jaxpr, rec = trace_training(model, batch, loss_fn)
    specs = rec.specs
    all_leaves, _ = sharding.tree_leaves(nnx.state(model, nnx.Param), path_rules)
    att = _attribute(grad_jaxpr, len(all_leaves))
    order, root_reads = att["order"], att["root_reads"]
    warnings = att["warnings"]
    if root_model is not None and not isinstance(root_model, nnx.Module):
        root_model = sharding.abstract(lambda: root_model(nnx.Rngs(0)))
    root_saved, root_fused, res_one = _root_saved(root_model or model, batch, loss_fn, rows)
    root_traffic = _root_traffic(root_model or model, batch, loss_fn, rows)

    def optimizer_bytes(params: Any) -> float:
        if tx is None:
            return 2.0 * sum(_nbytes(x) for x in jax.tree.leaves(params)
                             if jnp.issubdtype(x.dtype, jnp.inexact))
        return float(sum(_nbytes(x) for x in jax.tree.leaves(jax.eval_shape(tx.init, params))))

    def leaves_under(name: str | None) -> tuple[sharding.Leaf, ...]:
        names = [s.name for s in specs]
        if name is None:
            return tuple(x for x in all_leaves
                         if not any(x.path == n or x.path.startswith(n + "/") for n in names))
        return tuple(x for x in all_leaves if x.path == name or x.path.startswith(name + "/"))

    layers: list[LayerCost] = []
    probes: dict[str, tuple[Callable, Callable, tuple]] = {}
    root_leaves = leaves_under(None)
    for side in ("pre", "post"):
        used = tuple(x for x in root_leaves if all_leaves.index(x) in root_reads[side])
        if side == "pre" and not used and not root_reads["post"]:
            used = root_leaves  # unused root params: keep them on the first stage
        n = sum(math.prod(x.shape) for x in used)
        pbytes = float(sum(x.nbytes for x in used))
        avals, ones = root_saved[side]
        kept, kept_one = root_fused[side]
        fwd, bwd = att["root"][f"{side}_f"], att["root"][f"{side}_b"]
        layer = LayerCost(
            name=side, kind=side, fwd_flops=fwd.flops, bwd_flops=bwd.flops,
            transcendentals=fwd.transcendentals + bwd.transcendentals,
            recompute_flops={p: 0.0 for p in policies},
            saved={p: saved_from(avals, ones if res_one is not None else None, rows)
                   for p in policies},
            fused={p: saved_from(kept, kept_one if res_one is not None else None, rows)
                   for p in policies},
            params=used, share=1.0, param_count=float(n), param_bytes=pbytes, group=side,
            traffic={p: root_traffic for p in policies} if side == "post" else {},
            optimizer_bytes=optimizer_bytes([_leaf_aval(x) for x in used]),
            boundary_bytes=0.0)
        layers.append(layer)
    post = layers.pop()
    for idx in order + [s.index for s in specs if s.index not in order]:
        spec, call = specs[idx], rec.calls.get(idx)
        if call is None:
            warnings.append(f"layer {spec.name!r} was never called; it costs nothing here")
            continue
        a = analyse_layer(call, rows, policies)
        count = spec.stack or 1
        leaves = leaves_under(spec.name)
        pbytes = float(sum(x.nbytes for x in leaves)) / count
        out_bytes = _float_bytes(call.outputs)
        in_bytes = carried_input_bytes(call)
        if order and idx == order[0]:
            layers[0].boundary_bytes = in_bytes
        probes[spec.name] = a["probe"]
        for i in range(count):
            layers.append(LayerCost(
                name=f"{spec.name}/{i}" if spec.stack else spec.name,
                kind="block" if spec.stack else "layer", fwd_flops=a["fwd"], bwd_flops=a["bwd"],
                transcendentals=a["transcendentals"], recompute_flops=dict(a["recompute"]),
                skipped_flops=dict(a["skipped"]),
                saved=dict(a["saved"]), fused=dict(a["fused"]),
                transient=dict(a["transient"]), forward=dict(a["forward"]),
                staged=dict(a["staged"]), params=leaves,
                traffic=dict(a["traffic"]),
                share=1.0 / count,
                param_count=float(sum(math.prod(x.shape) for x in leaves)) / count,
                param_bytes=pbytes, optimizer_bytes=optimizer_bytes(call.params),
                boundary_bytes=out_bytes, input_bytes=in_bytes,
                act_itemsize=_itemsize(call.outputs), in_loop=idx in att["looped"],
                group=spec.name))
    layers.append(post)
    if len(layers) > 2:  # the root's activations are its neighbours' (the compute dtype)
        layers[0].act_itemsize, post.act_itemsize = layers[1].act_itemsize, \
            layers[-2].act_itemsize
    prev_out = layers[0].boundary_bytes
    for lay in layers[1:]:
        lay.input_bytes = lay.input_bytes or prev_out
        prev_out = lay.boundary_bytes
    batch_bytes = float(sum(_nbytes(x) for x in jax.tree.leaves(batch)))
    seq = next((int(x.shape[1]) for x in jax.tree.leaves(batch) if len(x.shape) >= 2), 0)
    return ModelCost(layers, rows, batch_bytes, att["program_fwd"].flops,
                     att["program_bwd"].flops, warnings, probes,
                     activation_names=frozenset(names), seq_len=seq)


