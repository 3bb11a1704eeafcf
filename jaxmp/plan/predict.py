"""Predict one candidate layout: per-device memory, FLOPs, bytes on each mesh axis, step time.

Everything is per device and per step, from the per-layer costs (:mod:`jaxmp.cost`), the
sharding rules resolved on the candidate mesh (:class:`~jaxmp.plan.context.Context`) and the
device profile. Layouts with pipeline stages go to :mod:`jaxmp.plan.pipeline`; this module
predicts the rest, where every device runs every layer:

* **memory**: parameters and Adam state as the rules shard them (their bytes per parameter
  follow the precision policy: float32 master weights and moments with bfloat16 compute are
  12 bytes, plus 8 for the gradients and the optimizer's update); the saved activations of
  every layer at the device's rows (the last layer's: the logits); the working set — the
  largest backward pass of one layer (recomputed activations under remat, activation
  gradients, attention scores) plus, under fsdp, its gathered weights and their full-size
  gradients. It is one layer's, so it does not grow with depth or microbatches.
* **communication**, ring formulas, bytes each device sends: ``data`` all-reduces gradients,
  2(N-1)/N·S, once per microbatch (inside the accumulation loop, as the step compiles);
  ``fsdp`` all-gathers weights (forward, and again in the backward pass of a scanned stack or
  under remat) and reduce-scatters gradients, (N-1)/N·S each, per microbatch; ``tensor``
  all-reduces a layer's activations once per tensor-split weight matrix.
* **time**: FLOPs at the profile's achievable rate (``peak_flops x efficiency``); tensor
  all-reduces on the critical path; fsdp and data collectives overlapped layer by layer with
  compute where the backend does that (:func:`~jaxmp.plan.context.overlapped`).
"""

from __future__ import annotations

import numpy as np

from jaxmp.mesh import AXES
from jaxmp.plan.context import STEP_STATE_BYTES, Context, Prediction, overlapped
from jaxmp.plan.layout import Layout
from jaxmp.plan.pipeline import predict_pipeline


def predict(ctx: Context, layout: Layout) -> Prediction:
    """Predict ``layout`` (with ``stage`` > 1: as the pipeline executor runs it)."""
    if layout.stages > 1:
        return predict_pipeline(ctx, layout)
    cost = ctx.cost
    sizes = layout.sizes
    data, fsdp, tensor = sizes["data"], sizes["fsdp"], sizes["tensor"]
    microbatches = layout.microbatches
    table = ctx.table(layout.remat, data, fsdp, tensor, microbatches,
                      layout.sequence_parallel)
    own = np.where(ctx.tied, 0.0, table.param_local)  # tied weights: stored once
    params = float(own.sum())
    opt = float((own * ctx.opt_ratio).sum())
    acts = float(table.kept.sum())
    k_work = int(np.argmax(table.work))
    working = float(table.work[k_work])
    name = cost.layers[k_work].group or cost.layers[k_work].name
    gathered = working - float(table.transient[k_work])
    working_parts = {f"{name} backward": float(table.transient[k_work])}
    if gathered:
        working_parts[f"{name} fsdp-gathered weights + grads"] = gathered
    batch = cost.batch_bytes / (data * fsdp)
    args = params + opt + batch + STEP_STATE_BYTES
    # The gradients and the optimizer's update, both parameter-sized; accumulating over
    # microbatches adds the running sum.
    grads = (3 if microbatches > 1 else 2) * params
    total = args + grads + acts + working

    comm = dict.fromkeys(AXES, 0.0)
    comm["tensor"] = microbatches * float(table.tensor_bytes.sum())
    comm["fsdp"] = microbatches * float(table.fsdp_bytes.sum())
    # The data-axis gradient reduction, encoded per compression.gradients: beside the
    # backward pass (XLA's), or once after the last microbatch with nothing to hide behind.
    at_end = layout.reduce_after_microbatches
    data_bytes = ctx.grad_bytes_factor * 2 * (data - 1) / data * table.param_local
    comm["data"] = float(data_bytes.sum())
    bw = ctx.link_bw(sizes)
    per_layer = microbatches * table.fsdp_bytes / bw["fsdp"] + (
        0.0 if at_end else data_bytes / bw["data"])
    exposed, hidden = overlapped(per_layer, microbatches * table.compute_time,
                                 float(table.first_gather_bytes.max()) / bw["fsdp"],
                                 ctx.profile.overlap)
    raw = {"fsdp": comm["fsdp"] / bw["fsdp"], "data": comm["data"] / bw["data"]}
    overlappable = {"fsdp": raw["fsdp"], "data": 0.0 if at_end else raw["data"]}
    total_o = sum(overlappable.values())
    share = {k: v / total_o if total_o else 0.0 for k, v in overlappable.items()}
    comm_s = dict.fromkeys(AXES, 0.0)
    comm_s.update({k: exposed * share[k] for k in raw})
    if at_end:
        comm_s["data"] = raw["data"]
    compute = microbatches * float(table.compute_time.sum())
    comm_s["tensor"] = microbatches * float((table.time - table.compute_time).sum())  # critical
    step = compute + sum(comm_s.values())
    flops_step = ctx.flops_per_step(layout.remat)
    return Prediction(
        param_bytes=params, optimizer_bytes=opt, grad_bytes=grads, activation_bytes=acts,
        working_bytes=working, batch_bytes=batch, argument_bytes=args, per_device_bytes=total,
        flops_per_step=flops_step, flops_per_device=flops_step / ctx.n, compute_s=compute,
        bubble_s=0.0, comm_s=comm_s, comm_bytes=comm, step_time_s=step,
        stages=[(0, len(cost.layers))], stage_time_s=[step],
        comm_hidden_s={k: hidden * share[k] for k in raw}, working_parts=working_parts,
        activation_parts={"saved by every layer": acts})
