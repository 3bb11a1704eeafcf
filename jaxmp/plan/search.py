"""Enumerate layouts (mesh factorisation × remat × microbatches × pipeline schedule), predict
each, rank them.

Every factorisation data × stage × fsdp × tensor of the device count is considered, subject to
the user's fixed axes, and dropped only for a stated reason: the batch does not split evenly,
an axis would shard nothing (tensor on dims it does not divide, fsdp on nothing), more stages
than blocks, or no layer stack to pipeline. With stages, the schedules are 1F1B and
interleaved 1F1B with 2-4 virtual stages (GPipe has the same bubble in the lockstep executor
and never less memory, so it is searched only when configured), and the microbatches are the
stage count times powers of two and the one-row-per-microbatch split. The rest are predicted
(:mod:`jaxmp.plan.predict`) and ranked: those that fit first, fastest first.

A plan is *runnable* when the trainer can execute it as configured: the configured remat policy
(unless ``auto``), gradient accumulation, pipeline settings, and — for stages — a model the
trainer knows how to split (a stacked layer module and a ``PipelineSpec``). Others are still
ranked and shown, with what they would need.
"""

from __future__ import annotations

import gc
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from jaxmp._util.fmt import fmt_bytes, fmt_time
from jaxmp.mesh import AXES
from jaxmp.plan.context import Context
from jaxmp.plan.prediction import Prediction
from jaxmp.plan.layout import Layout
from jaxmp.plan.predict import predict

SCHEDULES = ("1f1b", "interleaved")  # searched when pipeline.schedule is "auto"
VIRTUAL = (2, 3, 4)  # interleaved chunks per device, when pipeline.virtual_stages is "auto"
ACCUMULATION = (1, 2, 4)  # microbatches without stages, times the configured count
REFINED = 4  # the fastest fitting layouts that also try the remat policies the search skipped


@dataclass(frozen=True)
class PipelineOptions:
    """What the trainer will run with stages: ``"auto"`` lets the search choose."""

    schedule: str = "auto"
    virtual: int | str = "auto"
    runnable: bool = True  # the trainer can split this model into stages
    why_not: str = "needs a model the trainer can split into stages (a PipelineSpec)"


@dataclass
class Candidate:
    layout: Layout
    prediction: Prediction
    fits: bool
    blockers: tuple[str, ...]  # why the trainer cannot run it as configured (empty: it can)

    @property
    def runnable(self) -> bool:
        return not self.blockers

    @property
    def mesh(self) -> dict[str, int]:
        return self.layout.sizes


@dataclass
class SearchResult:
    ranked: list[Candidate]  # fitting first, then by predicted step time
    dropped: Counter = field(default_factory=Counter)  # reason -> count


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def factorisations(n: int, fixed: Mapping[str, int] | None = None) -> list[dict[str, int]]:
    """Every {data, stage, fsdp, tensor} with product ``n``; ``fixed`` axes (>= 1) are held."""
    fixed = {k: v for k, v in (fixed or {}).items() if v is not None and v >= 1}
    out = []
    for data in _divisors(n):
        for stage in _divisors(n // data):
            for fsdp in _divisors(n // (data * stage)):
                sizes = {"data": data, "stage": stage, "fsdp": fsdp,
                         "tensor": n // (data * stage * fsdp)}
                if all(sizes[a] == v for a, v in fixed.items()):
                    out.append(sizes)
    return out


def accumulation(rows_per_replica: int, microbatches: int | str) -> list[tuple[int, bool]]:
    """``(microbatches, configured)`` without stages: 1, 2 and 4 (times a configured count;
    others than the configured one are ranked but not runnable) that split the rows evenly."""
    base = 1 if microbatches == "auto" else int(microbatches)
    return [(base * k, microbatches == "auto" or k == 1) for k in ACCUMULATION
            if rows_per_replica % (base * k) == 0]


def pipeline_microbatches(stages: int, rows_per_replica: int, fixed: int | str = "auto"
                          ) -> list[int]:
    """Microbatch counts for ``stages`` stages: 1, 2, 4 and 8 times ``stages``, and
    microbatches of 4, 2 and 1 rows — those that split the rows evenly."""
    rows = rows_per_replica
    if fixed != "auto":
        return [int(fixed)] if rows % int(fixed) == 0 else []
    wanted = {stages * k for k in (1, 2, 4, 8)} | {rows // k for k in (4, 2, 1) if rows % k == 0}
    return sorted(m for m in wanted if stages <= m <= rows and rows % m == 0)


def schedules(stages: int, microbatches: int, blocks: int, opts: PipelineOptions
              ) -> list[tuple[str, int]]:
    """(schedule, virtual stages) pairs the executor accepts for ``stages`` stages and
    ``microbatches`` microbatches."""
    kinds = SCHEDULES if opts.schedule == "auto" else (opts.schedule,)
    out = []
    for kind in kinds:
        if kind == "interleaved":
            vs = VIRTUAL if opts.virtual == "auto" else (int(opts.virtual),)
            out += [(kind, v) for v in vs if v >= 2 and stages * v <= blocks
                    and microbatches % stages == 0 and microbatches >= stages]
        elif opts.virtual in ("auto", 1) and (kind == "gpipe" or microbatches >= stages):
            out.append((kind, 1))
    return out


def optimizer_choices(configured: str, data: int) -> list[tuple[str, bool]]:
    """``(optimizer_sharding, runnable as configured)`` to try in order, for ``data``
    replicas: the replicated state first; sharded over data next — it moves the same bytes
    (a reduce-scatter and an all-gather for the all-reduce) but its all-gather ends the step,
    so "auto" takes it only when the replicated state does not fit, and a configured "none"
    still shows what it would need."""
    if data <= 1:
        return [("none", True)]
    if configured == "data":
        return [("data", True)]
    return [("none", True), ("data", configured == "auto")]


def _dropped(ctx: Context, sizes: dict[str, int], fixed: Mapping[str, int]) -> str:
    """Why the search skips this factorisation ("" if it does not). An axis the user fixed
    is never skipped for sharding nothing: the Trainer warns about it instead."""
    data, stage, fsdp, tensor = (sizes[a] for a in AXES)
    blocks = ctx.n_blocks
    if ctx.cost.rows % (data * fsdp):
        return "batch not divisible by data x fsdp"
    if stage > 1 and not blocks:
        return "no layer stack to split into stages"
    if stage > blocks and stage > 1:
        return "more stages than blocks"
    if tensor > 1 and "tensor" not in fixed and not any(
            ctx.shard(i, fsdp, tensor).tensor_weights for i in ctx.first):
        return "tensor splits no weight (dims not divisible)"
    if fsdp > 1 and "fsdp" not in fixed and not any(
            ctx.shard(i, fsdp, 1).gathered > ctx.shard(i, fsdp, 1).local for i in ctx.first):
        return "fsdp shards no weight (dims not divisible)"
    return ""


@contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the duration: a search allocates tens of
    thousands of candidates that live to its end, and each allocation-triggered collection
    would scan them and everything the cost trace left on the heap (a quarter of the 1T
    row's planning time). Only reference cycles made meanwhile wait for the next collection."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def search(ctx: Context, fixed: Mapping[str, int] | None = None,
           remats: Sequence[str] | None = None, microbatches: int | str = "auto",
           configured_remat: str | None = None,
           pipeline: PipelineOptions | None = None,
           optimizer_sharding: str = "auto") -> SearchResult:
    """Predict and rank every allowed layout for ``ctx``'s model and device count.

    ``microbatches`` is ``train.microbatches`` (``"auto"``: searched); ``optimizer_sharding``
    is ``train.optimizer_sharding`` (see :func:`optimizer_choices`)."""
    with gc_paused():
        return _search(ctx, fixed, remats, microbatches, configured_remat, pipeline,
                       optimizer_sharding)


def _search(ctx: Context, fixed: Mapping[str, int] | None, remats: Sequence[str] | None,
            microbatches: int | str, configured_remat: str | None,
            pipeline: PipelineOptions | None, optimizer_sharding: str) -> SearchResult:
    cost, n = ctx.cost, ctx.n
    opts = pipeline or PipelineOptions()
    fixed = dict(fixed or {})
    # Cheapest first: once a runnable policy fits, the costlier ones are skipped (they are
    # never more runnable and seldom faster; the fastest layouts try them after the ranking).
    remats = sorted(remats or next(iter(cost.layers)).saved, key=ctx.flops_per_step)
    result = SearchResult([])
    skipped: dict[tuple, Sequence[str]] = {}  # layout -> the policies the break skipped
    groups: dict[int, tuple] = {}  # id(candidate) -> its layout
    unknown = set(fixed) - set(AXES)
    if unknown:
        raise ValueError(f"unknown mesh axis {sorted(unknown)[0]!r}")
    for sizes in factorisations(n, fixed):
        why = _dropped(ctx, sizes, fixed)
        if why:
            result.dropped[why] += 1
            continue
        stages = sizes["stage"]
        rows = cost.rows // (sizes["data"] * sizes["fsdp"])
        if stages == 1:
            layouts = [(count, "", 1, ok) for count, ok in accumulation(rows, microbatches)]
        else:
            layouts = [(count, kind, virtual, True)
                       for count in pipeline_microbatches(stages, rows, microbatches)
                       for kind, virtual in schedules(stages, count, ctx.n_blocks, opts)]
        if not layouts:
            result.dropped["batch too small for the microbatches"] += 1
            continue
        for count, kind, virtual, configured in layouts:
            group = (tuple(sizes.items()), count, kind, virtual, configured)
            for j, remat in enumerate(remats):
                remat_ok = configured_remat is None or remat == configured_remat
                made = _predict_remat(ctx, sizes, remat, count, kind, virtual, configured,
                                      remat_ok, opts, optimizer_sharding)
                result.ranked.extend(made)
                groups.update((id(c), group) for c in made)
                if any(c.fits for c in made) and remat_ok:
                    skipped[group] = remats[j + 1:]
                    break
    _rank(result)
    # A costlier policy is seldom faster, but it can be: it writes and reads fewer residuals.
    # The fastest few runnable layouts that fit also try the policies the break skipped.
    refined: list[tuple] = []
    for c in result.ranked if configured_remat is None else ():
        if len(refined) == REFINED or not c.fits:
            break
        group = groups.get(id(c))
        if c.runnable and skipped.get(group) and group not in refined:
            refined.append(group)
    for sizes, count, kind, virtual, configured in refined:
        for remat in skipped[(sizes, count, kind, virtual, configured)]:
            result.ranked.extend(_predict_remat(
                ctx, dict(sizes), remat, count, kind, virtual, configured,
                configured_remat is None or remat == configured_remat, opts,
                optimizer_sharding))
    _rank(result)
    return result


def _predict_remat(ctx: Context, sizes: Mapping[str, int], remat: str, count: int, kind: str,
                   virtual: int, configured: bool, remat_ok: bool, opts: PipelineOptions,
                   optimizer_sharding: str) -> list[Candidate]:
    """The candidates of one layout under one remat policy: sequence parallelism as
    :meth:`Context.sp_choices` tries it, each with the optimizer shardings tried until one
    fits (sharding the optimizer state more saves nothing that matters)."""
    made = []
    for sp in ctx.sp_choices(sizes):  # "auto": off and on, the ranking decides
        for zero, zero_ok in optimizer_choices(optimizer_sharding, sizes["data"]):
            layout = ctx.layout(sizes, remat, count, kind, virtual, zero, sp)
            pred = predict(ctx, layout)
            fits = bool(pred.per_device_bytes <= ctx.memory_limit)
            blockers = [] if remat_ok else [f"needs model.remat={remat!r}"]
            if not zero_ok:
                blockers.append(f"needs train.optimizer_sharding={zero!r}")
            if not configured:
                blockers.append(f"needs train.microbatches={count}")
            if sizes["stage"] > 1 and not opts.runnable:
                blockers.append(opts.why_not)
            made.append(Candidate(layout, pred, fits, tuple(blockers)))
            if fits:
                break
    return made


def _rank(result: SearchResult) -> None:
    """Fitting first, then fastest; on a tie the fewer microbatches (larger matmuls, a simpler
    program), then the less memory."""
    result.ranked.sort(key=lambda c: (not c.fits, c.prediction.step_time_s,
                                      c.layout.microbatches, c.prediction.per_device_bytes,
                                      len(c.blockers)))


def choose(result: SearchResult) -> tuple[Candidate | None, list[str]]:
    """The best runnable candidate that fits (else the runnable one needing least memory)."""
    notes = []
    runnable = [c for c in result.ranked if c.runnable]
    fitting = [c for c in runnable if c.fits]
    if fitting:
        return fitting[0], notes
    if runnable:
        best = min(runnable, key=lambda c: c.prediction.per_device_bytes)
        notes.append("no runnable plan is predicted to fit in device memory; chose the one "
                     "needing the least")
        return best, notes
    return None, ["no runnable plan (every candidate needs other settings)"]


def describe(layout: Layout) -> str:
    """``"remat full, 1f1b, 64 mb, sequence parallel"``: a layout's settings besides its
    mesh."""
    parts = [f"remat {layout.remat}"]
    if layout.stages > 1:
        parts.append(layout.schedule + (f" x{layout.virtual_stages}"
                                        if layout.virtual_stages > 1 else ""))
    parts.append(f"{layout.microbatches} mb")
    if layout.optimizer_sharding != "none":
        parts.append(f"optimizer over {layout.optimizer_sharding}")
    if layout.master_weights != "none":
        parts.append(f"{layout.master_weights} master")
    if layout.sequence_parallel:
        parts.append("sequence parallel")
    return ", ".join(parts)


def reason_lost(c: Candidate, best: Candidate, memory_limit: float) -> str:
    """Why ``c`` was not chosen over ``best``, in one line."""
    pc, pb = c.prediction, best.prediction
    if not c.fits:
        return (f"does not fit: {fmt_bytes(pc.per_device_bytes)} > {fmt_bytes(memory_limit)} "
                f"per device")
    ratio = pc.step_time_s / pb.step_time_s if pb.step_time_s else float("inf")
    if c.blockers:
        return f"not runnable: {'; '.join(c.blockers)} ({ratio:.2f}x the step time)"
    parts = {"compute": pc.compute_s - pb.compute_s, "pipeline bubble": pc.bubble_s - pb.bubble_s}
    for axis in AXES:
        parts[f"{axis} communication"] = pc.comm_s[axis] - pb.comm_s[axis]
    what, extra = max(parts.items(), key=lambda kv: kv[1])
    if ratio <= 1.0 + 1e-9:
        return (f"as fast ({ratio:.2f}x) but needs more memory: {fmt_bytes(pc.per_device_bytes)} "
                f"vs {fmt_bytes(pb.per_device_bytes)}")
    return f"{ratio:.2f}x the step time: +{fmt_time(extra)} {what}"
