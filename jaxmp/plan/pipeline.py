"""Predict a layout with pipeline stages as the executor (:mod:`jaxmp.pipeline.executor`) runs it.

From the same descriptions the executor uses — the split of the per-layer table into chunks
(:func:`jaxmp.pipeline.stages.split_layers`, by training FLOPs or layer count) and the
schedule (:class:`jaxmp.pipeline.schedule.Schedule`: ticks, microbatches in flight) — so the
prediction and the program cannot drift:

* **memory**, the same on every device (one SPMD program): the padded stack, ``V·Lmax`` block
  rows, and the embedding / head params replicated over stages, with their Adam state,
  gradients and update; the residual buffer — one slot per microbatch-chunk in flight on the
  busiest device (:meth:`Schedule.in_flight`), plus a spare, each holding what one chunk's
  forward keeps (``Lmax`` blocks' scan residuals; with GPipe also the head's: the logits);
  the activation and cotangent buffers at the stage boundary; the batch; the working set —
  one block's backward, the embedding's, or the last chunk run forward + backward in one tick
  (its blocks' residuals and the head's logits and their gradient).
* **time**: lockstep ticks, ``(V·M + P - 1)`` chunk times (:meth:`Schedule.step_units`), of
  which ``(P - 1)`` are the bubble, a chunk's extra work (the head's) charged in its own
  ticks only (:func:`lockstep_terms`); the boundary sends of
  every tick (:attr:`Schedule.n_ticks`) and the stage psum of the shared gradients; the data
  reduction of the device's gradients once per step, after the schedule; fsdp gathers and
  reduce-scatters per microbatch-chunk, overlapped with compute where the backend does that.
  Bytes are what the busiest device *executes*: a tick's ``lax.cond`` runs one branch, and a
  device idle in a bubble tick sends nothing but the boundary buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxmp.mesh import AXES
from jaxmp.pipeline.footprint import buffer_slots, chunk_ranges
from jaxmp.pipeline.schedule import Schedule
from jaxmp.pipeline.stages import StageSplit
from jaxmp.plan.context import Context, zero_divisor
from jaxmp.plan.layout import Layout
from jaxmp.plan.lookup import lookup_wire_bytes
from jaxmp.plan.master import master_terms
from jaxmp.plan.prediction import STEP_STATE_BYTES, Prediction
from jaxmp.plan.update import update_terms


@dataclass(frozen=True)
class Chunks:
    """A stage split as arrays over the cost model's layers (what every candidate sums)."""

    starts: np.ndarray  # first layer of each chunk
    ends: np.ndarray  # one past its last layer
    device: np.ndarray  # the stage each chunk runs on (chunk c on c % stages)
    per_chunk: tuple[int, ...]  # blocks per chunk
    max_blocks: int  # padded block rows per chunk
    busiest_blocks: int  # the most blocks one device runs

    def sums(self, prefix: np.ndarray) -> np.ndarray:
        """Per-chunk sums of a per-layer field given its prefix sums."""
        return prefix[self.ends] - prefix[self.starts]

    def busiest(self, prefix: np.ndarray, stages: int) -> float:
        """The largest per-device sum of a per-layer field (prefix sums given)."""
        per = self.sums(prefix)
        if len(per) == stages:
            return float(per.max())
        return float(np.bincount(self.device, per, minlength=stages).max())


def chunks(ctx: Context, split: StageSplit) -> Chunks:
    """``split`` (over the folded table) as ranges of ``ctx``'s cost model, cached."""
    def make() -> Chunks:
        ranges = np.array(chunk_ranges(split, ctx.span, len(ctx.cost.layers)))
        device = np.arange(len(ranges)) % split.stages
        per = split.per_chunk
        return Chunks(ranges[:, 0], ranges[:, 1], device, tuple(per), split.max_blocks,
                      int(np.bincount(device, per, minlength=split.stages).max()))

    return ctx.cached(("chunks", split), make)


_SUMMED = ("time", "compute_time", "tensor_bytes")  # per chunk, via prefix sums


@dataclass(frozen=True)
class _Terms:
    """One (remat, data, fsdp, tensor, microbatches)'s per-device numbers of a block, of the
    layers before the stack (``pre``) and after it (``post``)."""

    block: dict[str, float]  # a block's row of the LayerTable
    pre_saved: float
    post_saved: float
    pre_work: float
    post_work: float
    boundary: float  # one microbatch's activations at a stage boundary
    shared: float  # parameter bytes outside the stack (every stage holds them)
    shared_opt: float
    shared_gather: float  # the shared params' fsdp gather, once per step (tied weights once)
    prefix: dict[str, np.ndarray]  # prefix sums of the time and traffic fields; "fsdp_bytes":
    # per microbatch, less the weight gathers (the resident rows and shared params', per step)


def _terms(ctx: Context, remat: str, data: int, fsdp: int, tensor: int,
           microbatches: int, sp: bool = False) -> _Terms:
    def make() -> _Terms:
        table = ctx.table(remat, data, fsdp, tensor, microbatches, sp, staged=True)
        lo, hi = ctx.span
        shared, shared_opt = ctx.outside_stack(fsdp, tensor)
        # sequence parallel: the stream crosses stages split over tensor too
        boundary = ctx.cost.layers[lo].input_bytes / (data * fsdp * microbatches) / (
            tensor if sp else 1)
        outside = np.ones(len(ctx.cost.layers), bool)
        outside[lo:hi] = False
        once = float(np.where(ctx.tied | ~outside, 0.0, table.first_gather_bytes).sum())
        per_microbatch = table.fsdp_bytes - table.gathers * table.first_gather_bytes
        if lo and fsdp > 1 and table.first_gather_bytes[:lo].any():
            # The lookup's gradient (jaxmp.models.lookup): per microbatch an all-to-all moves
            # the stream's gradient to the table's embed shards and the ids are gathered over
            # fsdp once per step (each microbatch's share here), beside the table's gradient
            # reduce-scattered with the chunk's (measured: docs/planner.md §7 "Stop 33").
            tokens = ctx.cost.rows * ctx.cost.seq_len / (data * fsdp * microbatches)
            per_microbatch[0] += lookup_wire_bytes(fsdp, boundary, tokens)
        prefix = {name: table.prefix(name) for name in _SUMMED}
        prefix["fsdp_bytes"] = np.concatenate([[0.0], np.cumsum(per_microbatch)])
        return _Terms(table.row(lo), float(table.saved[:lo].sum()),
                      float(table.saved[hi:].sum()), float(table.work[:lo].max(initial=0.0)),
                      float(table.work[hi:].max(initial=0.0)), boundary, shared,
                      shared_opt, once, prefix)

    return ctx.cached(("terms", remat, data, fsdp, tensor, microbatches, sp), make)


def resident_weight_bytes(blk: dict[str, float], fsdp: int, rows: int,
                          shared_gather: float = 0.0) -> float:
    """The device's stack rows and the shared params gathered over fsdp once per step and held
    through the tick loop (:func:`jaxmp.pipeline.ticks.resident`), in the gathers' wire
    dtype (``shared_gather``: the shared params' one gather's bytes on the wire)."""
    return (rows * blk["first_gather_bytes"] + shared_gather) * fsdp / (fsdp - 1) \
        if fsdp > 1 else 0.0


def fsdp_step_bytes(ch: Chunks, prefix: np.ndarray, blk: dict[str, float], stages: int,
                    microbatches: int, rows: int, shared_gather: float = 0.0) -> float:
    """fsdp bytes of the busiest device per step: the stack's rows and the shared params
    gathered once (:func:`resident_weight_bytes`), not per microbatch-chunk; per microbatch
    (``prefix``: per layer, without the gathers) the gradients' reduce-scatters, each
    backward's own, and the lookup's all-to-all and token ids (jaxmp.models.lookup)."""
    return microbatches * ch.busiest(prefix, stages) + rows * blk["first_gather_bytes"] \
        + shared_gather


def lockstep_terms(chunk_time: np.ndarray, chunk_compute: np.ndarray,
                   schedule: Schedule) -> tuple[float, float, float]:
    """``(compute, tensor, bubble)`` seconds of the tick loop, chunk ``c`` taking
    ``chunk_time[c]`` (of which ``chunk_compute[c]`` compute, the rest tensor all-reduces).

    Each tick lasts as long as its slowest device (:meth:`Schedule.lockstep_time`), and a
    device runs a chunk's extra work only in that chunk's ticks: the embedding's in chunk 0's,
    the head and loss only in the last chunk's (the executor's ``lax.cond``), M of the
    V·M + P − 1 ticks. So the step is at most ``step_units()`` ticks of the fastest chunk
    plus, per microbatch, every chunk's excess over it (a tick's maximum is at most its base
    plus the excesses of the chunks run in it) — and at most ``step_units()`` ticks of the
    slowest chunk; the smaller bound is charged. With one slow chunk (the head's) the first is
    exact: GPT-3 175B on 8 stages × 6 virtual, 64 microbatches, 11.270 s against the tick
    table's 11.262 (the slowest chunk's pace: 13.12)."""
    p, m, v = schedule.stages, schedule.microbatches, schedule.virtual
    units = schedule.step_units()
    fast, slow = int(np.argmin(chunk_time)), int(np.argmax(chunk_time))
    excess = m * float((chunk_time - chunk_time[fast]).sum())
    if units * float(chunk_time[fast]) + excess < units * float(chunk_time[slow]):
        compute = v * m * float(chunk_compute[fast]) \
            + m * float((chunk_compute - chunk_compute[fast]).sum())
        pace = float(chunk_time[fast])
        return compute, v * m * pace + excess - compute, (p - 1) * pace
    pace = float(chunk_time[slow])
    compute = v * m * float(chunk_compute[slow])
    return compute, v * m * pace - compute, (p - 1) * pace


def predict_pipeline(ctx: Context, layout: Layout) -> Prediction:
    """Predict ``layout`` (``stage`` > 1) from its split; the schedule validates itself (bad
    input raises)."""
    if ctx.span is None or layout.split is None:
        raise ValueError("the model has no layer stack to split into pipeline stages")
    sizes = layout.sizes
    data, stages, fsdp, tensor = (sizes[a] for a in AXES)
    microbatches, virtual = layout.microbatches, layout.virtual_stages
    schedule = Schedule(layout.schedule, stages, microbatches, virtual)
    ch = chunks(ctx, layout.split)
    k = _terms(ctx, layout.remat, data, fsdp, tensor, microbatches,
               layout.sequence_parallel)
    blk, lmax = k.block, ch.max_blocks
    prefix = k.prefix

    # Parameters: the padded stack's rows and the shared (embedding, head) params on every stage.
    params = virtual * lmax * blk["param_local"] + k.shared
    # Optimizer state sharded over data divides it; the update, though sliced too, comes after
    # the schedule has freed its buffers, so the peak (and this term) keeps two param-sized
    # arrays either way (GPU-compiled: docs/benchmarks.md). A float32 master: see master_terms.
    m = master_terms(ctx.master_factor, layout, params, virtual * lmax * blk["param_local"]
                     * ctx.opt_ratio[ctx.span[0]] + k.shared_opt, zero_divisor(layout))
    opt = m.optimizer
    # In the tick loop: the chunks' float32 gradient sum (jaxmp.plan.update; the data reduction
    # comes after the schedule) and a param-sized array (the 16-bit params a master is cast
    # to; without one, the update's). After it, the loop's buffers freed: the update's
    # temporaries, as the plain step's.
    accumulator, after = update_terms(ctx, m, params, layout, zero_divisor(layout), True)
    in_loop = accumulator + (m.copy or params)

    # Buffers, as wide as the busiest device needs (plus the spare slot idle ticks write).
    slots = buffer_slots(schedule)
    residual = lmax * blk["saved"] + k.pre_saved + (0.0 if schedule.folds_last else k.post_saved)
    stash = (slots.res + 1) * residual
    # A forward's residuals are made as a stack of their own and written into their slot at the
    # tick's end: the compiled tick holds one chunk's residuals beside the buffer.
    in_transit = residual
    boundary = (slots.act + 1 + slots.ct + 1 + 2) * k.boundary  # act, ct, the sent y and gx
    acts = stash + in_transit + boundary
    batch = 2 * ctx.cost.batch_bytes / (data * fsdp)  # the batch, microbatched copy: all stages

    # One tick's work: a block's backward, the embedding's, or the folded last chunk.
    options = {"a block's backward": blk["work"], "the embedding's backward": k.pre_work,
               ("the last chunk's forward+backward (head and logits)" if schedule.folds_last
                else "the head's backward (logits)"):
               (lmax * blk["saved"] if schedule.folds_last else 0.0) + k.post_work}
    what = max(options, key=options.get)
    chunk_grads = lmax * blk["param_local"]
    resident = resident_weight_bytes(blk, fsdp, virtual * lmax, k.shared_gather)
    working = options[what] + chunk_grads + resident
    grads = max(in_loop, after - acts - working)
    args = m.stored + opt + batch + STEP_STATE_BYTES
    total = args + grads + acts + working

    # Time: lockstep ticks (compute, the tensor all-reduces inside them, the bubble).
    chunk_time, chunk_compute = ch.sums(prefix["time"]), ch.sums(prefix["compute_time"])
    work_units = virtual * microbatches
    compute, in_ticks, bubble = lockstep_terms(chunk_time, chunk_compute, schedule)
    comm = dict.fromkeys(AXES, 0.0)
    comm["tensor"] = microbatches * ch.busiest(prefix["tensor_bytes"], stages)
    comm["fsdp"] = fsdp_step_bytes(ch, prefix["fsdp_bytes"], blk, stages, microbatches,
                                   virtual * lmax, k.shared_gather)
    if data > 1:  # once per step, after the schedule (jaxmp.compression.reduce), encoded per
        # compression.gradients: the device's chunks of the stack and the shared params
        comm["data"] = ctx.grad_bytes_factor * m.data_factor(microbatches, zero_divisor(
            layout)) * (data - 1) / data * (
            ch.busiest_blocks * blk["param_local"] + k.shared)
    comm["stage"] = schedule.n_ticks * 2 * k.boundary + 2 * (stages - 1) / stages * k.shared
    bw = ctx.link_bw(sizes)
    comm_s = {axis: comm[axis] / bw[axis] for axis in AXES}
    comm_s["tensor"] = in_ticks  # inside the ticks, on the critical path
    hidden = {"fsdp": 0.0}
    if ctx.profile.overlap and comm_s["fsdp"]:
        first = work_units * blk["first_gather_bytes"] / bw["fsdp"]  # each chunk's first
        shown = min(comm_s["fsdp"], max(0.0, comm_s["fsdp"] - compute) + first)
        hidden["fsdp"], comm_s["fsdp"] = comm_s["fsdp"] - shown, shown
    step = compute + bubble + sum(comm_s.values())
    flops_step = ctx.flops_per_step(layout.remat)
    busy = np.bincount(ch.device, chunk_time, minlength=stages) * microbatches
    return Prediction(
        param_bytes=m.stored, optimizer_bytes=opt, grad_bytes=grads, activation_bytes=acts,
        working_bytes=working, batch_bytes=batch, argument_bytes=args, per_device_bytes=total,
        flops_per_step=flops_step, flops_per_device=flops_step / ctx.n, compute_s=compute,
        bubble_s=bubble, comm_s=comm_s, comm_bytes=comm, step_time_s=step,
        stages=list(zip(ch.starts.tolist(), ch.ends.tolist())), stage_time_s=busy.tolist(),
        comm_hidden_s=hidden,
        working_parts={what: options[what], "a chunk's parameter gradients": chunk_grads,
                       "the stack's rows and shared params gathered over fsdp": resident},
        activation_parts={f"residuals: {slots.res + 1} slots x {lmax} block(s)": stash,
                          "a forward's residuals before their slot": in_transit,
                          "boundary buffers (activations, cotangents)": boundary},
        blocks_per_chunk=list(ch.per_chunk))
