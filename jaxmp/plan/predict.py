"""Predict one candidate layout: per-device memory, FLOPs, bytes on each mesh axis, step time.

Everything is per device and per step, from the per-layer costs (:mod:`jaxmp.cost`), the
sharding rules resolved on the candidate mesh (:class:`~jaxmp.plan.context.Context`) and the
device profile. Layouts with pipeline stages go to :mod:`jaxmp.plan.pipeline`; this module
predicts the rest, where every device runs every layer:

* **memory**: the arguments — parameters and Adam state as the rules shard them (float32
  master weights and moments: 12 bytes per parameter) and the batch — plus the largest of
  what the step holds beside them: during each layer's backward pass (:func:`backward_phases`;
  the largest is usually the head's, right after the forward pass) the activations still
  saved (every layer's up to this one; a scanned stack's whole), the gradients made so far
  (a stack's whole buffer, in the dtype fsdp reduces them in), the layer's working set
  (recomputed activations under remat, activation gradients, attention scores, and under
  fsdp its gathered weights and their full-size gradients, in the wire dtypes) and the
  narrow copies of the fsdp shards the gathers read; or, after it, the float32 gradients and
  the optimizer's update. Accumulating microbatches adds a float32 running sum.
* **optimizer state sharded over data** (``train.optimizer_sharding``): the Adam state and
  the update divide by ``data``; the gradient reduction becomes a reduce-scatter and an
  all-gather of the updated params (the same bytes), the all-gather exposed at the step's end.
* **float32 master weights** of 16-bit params (``train.master_weights``,
  :func:`~jaxmp.plan.master.master_terms`): the arguments hold the float32 master and
  moments (divided by ``data`` with the optimizer sharded); the step holds the 16-bit copy
  the model computes with, and its gradients reach the optimizer in float32.
* **communication**, ring formulas, bytes each device sends: ``data`` all-reduces gradients,
  2(N-1)/N·S (weight matrices' in the compute dtype: :func:`data_reduction_bytes`), once
  per microbatch (inside the accumulation loop, as the step compiles);
  ``fsdp`` all-gathers weights (forward, and again in the backward pass of a scanned stack or
  under remat) and reduce-scatters gradients, (N-1)/N·S each, per microbatch; ``tensor``
  all-reduces a layer's activations once per tensor-split weight matrix.
* **time**: the FLOPs the device runs (less a causal kernel's masked half) at the profile's
  achievable rate (``peak_flops x efficiency``), plus memory traffic at its ``memory_bw``:
  saved activations written and read back, per-microbatch weight casts and float32
  accumulation, the optimizer's update (:func:`fixed_memory_time`); tensor
  all-reduces on the critical path; fsdp and data collectives overlapped layer by layer with
  compute where the backend does that (:func:`overlapped`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxmp.mesh import AXES
from jaxmp.plan.context import Context, LayerTable, zero_divisor
from jaxmp.plan.forward import forward_work
from jaxmp.plan.head import deferred_head_grads, held_below_head
from jaxmp.plan.layout import Layout
from jaxmp.plan.master import MasterTerms, master_terms
from jaxmp.plan.pipeline import predict_pipeline
from jaxmp.plan.prediction import STEP_STATE_BYTES, Prediction
from jaxmp.plan.update import update_terms

# A GPT block's rings (jaxmp.sharding.ring): two column-parallel ones (the qkv and MLP-in
# projections: forward, and backward the input gradient's ring and the weight gradient's
# re-gathering one) and two row-parallel ones (attention-out and MLP-out: forward and the
# transposed backward), each ``t - 1`` sends per microbatch.
RING_SENDS_PER_BLOCK = 2 * 3 + 2 * 2
# The fixed cost of one ring step on a GPU (a neighbour send's launch and handshake beside a
# matmul's launch): NCCL's small-message point-to-point latency is microseconds (nccl-tests
# sendrecv over NVLink). An estimate, not measured here (no GPU).
RING_STEP_LATENCY_S = 10e-6


def predict(ctx: Context, layout: Layout) -> Prediction:
    """Predict ``layout`` (with ``stage`` > 1: as the pipeline executor runs it)."""
    if layout.stages > 1:
        return predict_pipeline(ctx, layout)
    cost = ctx.cost
    sizes = layout.sizes
    data, fsdp, tensor = sizes["data"], sizes["fsdp"], sizes["tensor"]
    microbatches = layout.microbatches
    table = ctx.table(layout.remat, data, fsdp, tensor, microbatches, layout.sequence_parallel)
    own = np.where(ctx.tied, 0.0, table.param_local)  # tied weights: stored once
    params = float(own.sum())
    zero = zero_divisor(layout)
    m = master_terms(ctx.master_factor, layout, params, float((own * ctx.opt_ratio).sum()),
                     zero)
    opt = m.optimizer
    batch = cost.batch_bytes / (data * fsdp)
    args = m.stored + opt + batch + STEP_STATE_BYTES
    # with microbatches the step adds a stack's gradients into the running sum inside the
    # backward (jaxmp.gradsum): no stack-sized gradient buffer beside it
    phase = backward_phases(table, ctx.in_loop, ctx.tied, summed=microbatches > 1)
    head = held_below_head(ctx, data, fsdp, tensor, microbatches, layout.sequence_parallel)
    deferred = deferred_head_grads(ctx, np.where(ctx.tied, 0.0, table.grads), head)
    phase = Phases(phase.live, phase.grads - deferred, phase.total + head - deferred)
    # a scanned stack's forward body beside its whole stacks, where larger (GPUs; forward.py)
    body = forward_work(ctx, layout.remat, fsdp, tensor,
                        cost.rows / (data * fsdp * microbatches), layout.sequence_parallel)
    forward = np.where(body > 0, phase.live + body, 0.0)
    in_forward = float(forward.max()) > float(phase.total.max())
    if in_forward:
        phase = Phases(phase.live, np.zeros_like(phase.grads), forward)
    k = int(np.argmax(phase.total))
    # the data reduction in flight beside that backward: its layer's gradients (update.py)
    accumulator, update = update_terms(ctx, m, params, layout, zero, microbatches > 1,
                                       float(table.grads[k]))
    cast = float(table.cast.sum()) + m.copy
    during = cast + accumulator + float(phase.total[k])
    name = cost.layers[k].group or cost.layers[k].name
    if during >= update:
        acts = float(phase.live[k])
        if in_forward:
            grads, working = accumulator, float(body[k]) + cast
            working_parts = {f"{name} forward, beside the stacks": float(body[k])}
        else:
            grads = float(phase.grads[k]) + accumulator
            working = float(table.work[k]) + cast + float(head[k])
            gathered = float(table.work[k] - table.transient[k])
            working_parts = {f"{name} backward": float(table.transient[k])}
            if head[k]:
                working_parts["the head's output gradient, held to its weight gradient"] = \
                    float(head[k])
            if gathered:
                working_parts[f"{name} fsdp-gathered weights + grads"] = gathered
        if cast - m.copy:
            working_parts["narrow copies of the fsdp shards"] = cast - m.copy
        if m.copy:
            working_parts["the 16-bit params cast from the float32 master"] = m.copy
    else:
        acts, grads, working, working_parts = 0.0, update, 0.0, {}
    total = args + grads + acts + working
    comm = dict.fromkeys(AXES, 0.0)
    comm["tensor"] = microbatches * float(table.tensor_bytes.sum())
    comm["fsdp"] = microbatches * float(table.fsdp_bytes.sum())
    # The data-axis gradient reduction, encoded per compression.gradients: beside the
    # backward pass (XLA's), or once after the last microbatch with nothing to hide behind.
    at_end = layout.reduce_after_microbatches
    data_bytes = data_reduction_bytes(ctx, layout, table, m, microbatches, zero)
    comm["data"] = float(data_bytes.sum())
    bw = ctx.link_bw(sizes)
    # Sharded optimizer state: the updated slices are all-gathered after the update, with
    # nothing left to hide behind — half the all-reduce's bytes move there.
    gather_after = 0.5 if zero > 1 and not at_end else 0.0
    per_layer = microbatches * table.fsdp_bytes / bw["fsdp"] + (
        0.0 if at_end else (1 - gather_after) * data_bytes / bw["data"])
    # Each microbatch's first weight gather waits: the accumulation loop's body issues it at
    # its top, with no matmul before it (docs/planner.md §7 "Stop 34").
    exposed, hidden = overlapped(per_layer, microbatches * table.compute_time,
                                 microbatches * float(table.first_gather_bytes.max())
                                 / bw["fsdp"], ctx.profile.overlap)
    raw = {"fsdp": comm["fsdp"] / bw["fsdp"], "data": comm["data"] / bw["data"]}
    overlappable = {"fsdp": raw["fsdp"],
                    "data": 0.0 if at_end else (1 - gather_after) * raw["data"]}
    total_o = sum(overlappable.values())
    share = {k: v / total_o if total_o else 0.0 for k, v in overlappable.items()}
    comm_s = dict.fromkeys(AXES, 0.0)
    comm_s.update({k: exposed * share[k] for k in raw})
    if at_end:
        comm_s["data"] = raw["data"]
    comm_s["data"] += gather_after * raw["data"]
    compute = microbatches * float(table.compute_time.sum()) \
        + fixed_memory_time(ctx, table, m, params, microbatches, zero)
    comm_s["tensor"], comm_hidden_tensor = tensor_time(ctx, layout, table, microbatches)
    step = compute + sum(comm_s.values())
    flops_step = ctx.flops_per_step(layout.remat)
    return Prediction(
        param_bytes=m.stored, optimizer_bytes=opt, grad_bytes=grads, activation_bytes=acts,
        working_bytes=working, batch_bytes=batch, argument_bytes=args, per_device_bytes=total,
        flops_per_step=flops_step, flops_per_device=flops_step / ctx.n, compute_s=compute,
        bubble_s=0.0, comm_s=comm_s, comm_bytes=comm, step_time_s=step,
        stages=[(0, len(cost.layers))], stage_time_s=[step],
        comm_hidden_s={**{k: hidden * share[k] for k in raw}, "tensor": comm_hidden_tensor},
        working_parts=working_parts,
        activation_parts={f"saved, live in {name}'s backward": acts})


def tensor_time(ctx: Context, layout: Layout, table: LayerTable,
                microbatches: int) -> tuple[float, float]:
    """(exposed, hidden) seconds of the tensor collectives. On the critical path, except a
    block's under sequence parallelism where the model runs them as rings
    (:mod:`jaxmp.sharding.ring`, not inside pipeline stages): each of the ``t - 1`` sends of
    a ring rides beside one sequence block's matmul, so up to ``(t-1)/t`` of the block's
    compute hides them (GPU-compiled: every send has a matmul between start and done;
    docs/planner.md §7). What the ring cannot hide is its steps' fixed cost: each send (and
    the smaller matmul beside it) is a launch and a handshake, :data:`RING_STEP_LATENCY_S` on
    the critical path — so at small widths, with little to hide, the rings cost more than
    they save and the planner leaves sequence parallelism (and with it the rings) off."""
    t = layout.sizes["tensor"]
    raw = microbatches * (table.time - table.compute_time)
    if not (ctx.rings and layout.sequence_parallel and t > 1 and layout.sizes["stage"] == 1):
        return float(raw.sum()), 0.0
    cover = microbatches * table.compute_time * (t - 1) / t
    hidden = np.where(ctx.blocks, np.minimum(raw, cover), 0.0)
    steps = microbatches * ctx.n_blocks * RING_SENDS_PER_BLOCK * (t - 1)
    return float((raw - hidden).sum()) + steps * RING_STEP_LATENCY_S, float(hidden.sum())


def fixed_memory_time(ctx: Context, table: LayerTable, m: MasterTerms, params: float,
                      microbatches: int, zero: int) -> float:
    """Seconds of memory traffic outside the layers' compute, at the profile's memory
    bandwidth (0 on profiles without one): per microbatch, the compute-dtype casts of the
    weight matrices (read wide, written narrow) and, accumulating, the float32 running sum
    (read it and the microbatch's gradients, write it); per step, Adam's update (read the
    params, gradients and both moments, write params and moments)."""
    bw = ctx.profile.memory_bw
    if not bw:
        return 0.0
    narrow = 0.5 if ctx.compute_dtype in ("bfloat16", "float16") else 0.0
    casts = float(table.matrices.sum()) * (1 + narrow) if narrow else 0.0
    sums = 3 * params * m.wide if microbatches > 1 else 0.0
    update = (2 * m.stored + params * m.wide) / zero + 2 * m.optimizer
    return (microbatches * (casts + sums) + update) / bw


def data_reduction_bytes(ctx: Context, layout: Layout, table: LayerTable, m: MasterTerms,
                         microbatches: int, zero: int) -> np.ndarray:
    """Per layer, the bytes each device sends to reduce its gradients over ``data`` (ring
    all-reduce, 2(N-1)/N·S), encoded per ``compression.gradients``. Uncompressed and beside
    the backward pass (XLA's reduction, not the reducer's after the microbatches), a weight
    matrix's gradient is reduced where the partitioner places it: at its weight-gradient
    matmul, in that matmul's output dtype — the compute dtype (bf16 on GPUs, measured with
    ``--verify --aot``, docs/planner.md §7) — and cast to the parameter's dtype after; the
    lookup's scatter (but in the step's 16-bit copy where fsdp makes one) and vectors stay in
    the parameter's dtype. With a float32 master of 16-bit params,
    :meth:`~jaxmp.plan.master.MasterTerms.data_factor` says it."""
    data = layout.sizes["data"]
    if m.copy:
        return ctx.grad_bytes_factor * m.data_factor(microbatches, zero) * (data - 1) / data \
            * table.param_local
    local = table.param_local
    narrow = ctx.compute_dtype in ("bfloat16", "float16") and not ctx.profile.upcasts_16bit \
        and layout.compression.kind == "none" and not layout.reduce_after_microbatches
    if narrow:
        local = local - table.matrices * (1 - 2 / 4)  # float32 master weights, 16-bit grads
        if ctx.cost.sharded_lookup:  # its gradient comes in the dtype of the step's 16-bit
            # copy of the table, where fsdp makes one (jaxmp.models.lookup)
            local = np.where((ctx.kinds == "pre") & (table.cast > 0), table.cast, local)
    return ctx.grad_bytes_factor * 2 * (data - 1) / data * local


@dataclass(frozen=True)
class Phases:
    """Per layer, what the device holds while that layer's backward pass runs (the backward
    visits the layers last to first): ``live`` activations — every layer's up to this one, and
    a layer stack's whole (a scan's residual buffers are freed when the loop ends);
    ``grads`` — the gradients of the layers done, and a stack's whole buffer (the scan's
    output); ``total`` — those plus the layer's working set."""

    live: np.ndarray
    grads: np.ndarray
    total: np.ndarray


def backward_phases(table: LayerTable, in_loop: np.ndarray, tied: np.ndarray,
                    summed: bool = False) -> Phases:
    """:class:`Phases` of a :class:`~jaxmp.plan.context.LayerTable` (``in_loop``: the layers
    of a scanned stack; ``tied``: layers whose parameters another layer holds; ``summed``: the
    stack's gradients go straight into the microbatches' running sum)."""
    kept = table.kept
    held = np.where(tied | (in_loop.astype(bool) if summed else False), 0.0, table.grads)
    after = lambda x: np.concatenate([np.cumsum(x[::-1])[::-1][1:], [0.0]])  # noqa: E731
    live = np.cumsum(kept) + np.where(in_loop, after(kept * in_loop), 0.0)
    grads = after(held) + np.where(in_loop, np.cumsum(held * in_loop), 0.0)
    return Phases(live, grads, live + grads + table.work)


def overlapped(comm: np.ndarray, compute: np.ndarray, first: float, overlap: bool
               ) -> tuple[float, float]:
    """``(exposed, hidden)`` seconds of per-layer collectives ``comm`` beside per-layer
    ``compute``, as XLA's latency-hiding scheduler runs them: layer i's collectives (gathering
    the next layer's weights, reducing its own gradients) run while a layer computes, so only
    what is longer than that compute shows, plus ``first`` — the first weight gather, which
    nothing precedes. Without ``overlap`` (the CPU backend) everything shows."""
    total = float(comm.sum())
    if not overlap:
        return total, 0.0
    exposed = min(total, float(np.maximum(comm - compute, 0.0).sum()) + first)
    return exposed, total - exposed
