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

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from jaxmp._util.fmt import fmt_bytes, fmt_time
from jaxmp.mesh import AXES
from jaxmp.plan.context import Context, Layout, Prediction
from jaxmp.plan.predict import predict

SCHEDULES = ("1f1b", "interleaved")  # searched when pipeline.schedule is "auto"
VIRTUAL = (2, 3, 4)  # interleaved chunks per device, when pipeline.virtual_stages is "auto"


@dataclass(frozen=True)
class PipelineOptions:
    """What the trainer will run with stages: ``"auto"`` lets the search choose."""

    schedule: str = "auto"
    virtual: int | str = "auto"
    microbatches: int | str = "auto"
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


def _accumulation(rows_per_replica: int, grad_accum: int) -> list[int]:
    return [m for m in (grad_accum, 2 * grad_accum, 4 * grad_accum) if rows_per_replica % m == 0]


def pipeline_microbatches(p: int, rows_per_replica: int, fixed: int | str = "auto") -> list[int]:
    """Microbatch counts for ``p`` stages: 1, 2, 4 and 8 times ``p``, and microbatches of 4, 2
    and 1 rows — those that split the rows evenly."""
    r = rows_per_replica
    if fixed != "auto":
        return [int(fixed)] if r % int(fixed) == 0 else []
    wanted = {p * k for k in (1, 2, 4, 8)} | {r // k for k in (4, 2, 1) if r % k == 0}
    return sorted(m for m in wanted if p <= m <= r and r % m == 0)


def _schedules(p: int, m: int, blocks: int, opts: PipelineOptions) -> list[tuple[str, int]]:
    """(schedule, virtual stages) pairs the executor accepts for ``p`` stages, ``m`` microbatches."""
    kinds = SCHEDULES if opts.schedule == "auto" else (opts.schedule,)
    out = []
    for kind in kinds:
        if kind == "interleaved":
            vs = VIRTUAL if opts.virtual == "auto" else (int(opts.virtual),)
            out += [(kind, v) for v in vs if v >= 2 and p * v <= blocks and m % p == 0
                    and m >= p]
        elif opts.virtual in ("auto", 1) and (kind == "gpipe" or m >= p):
            out.append((kind, 1))
    return out


def search(ctx: Context, fixed: Mapping[str, int] | None = None,
           remats: Sequence[str] | None = None, grad_accum: int = 1,
           configured_remat: str | None = None,
           pipeline: PipelineOptions | None = None) -> SearchResult:
    """Predict and rank every allowed layout for ``ctx``'s model and device count."""
    cost, n = ctx.cost, ctx.n
    opts = pipeline or PipelineOptions()
    # Cheapest first: once a runnable policy fits, the costlier ones are dominated (slower,
    # never more runnable) and are not predicted.
    remats = sorted(remats or next(iter(cost.layers)).saved, key=ctx.flops_per_step)
    blocks = ctx.span[1] - ctx.span[0] if ctx.span else 0
    result = SearchResult([])
    unknown = set(fixed or {}) - set(AXES)
    if unknown:
        raise ValueError(f"unknown mesh axis {sorted(unknown)[0]!r}")
    for sizes in factorisations(n, fixed):
        d, p, f, t = (sizes[a] for a in AXES)
        if cost.rows % (d * f):
            result.dropped[f"batch {cost.rows} not divisible by data x fsdp"] += 1
            continue
        if p > 1 and not blocks:
            result.dropped["no layer stack to split into stages"] += 1
            continue
        if p > blocks and p > 1:
            result.dropped["more stages than blocks"] += 1
            continue
        if t > 1 and not any(ctx.shard(i, f, t).tensor_weights for i in ctx.first):
            result.dropped["tensor splits no weight (dims not divisible)"] += 1
            continue
        if f > 1 and not any(ctx.shard(i, f, 1).gathered > ctx.shard(i, f, 1).local
                             for i in ctx.first):
            result.dropped["fsdp shards no weight (dims not divisible)"] += 1
            continue
        rows = cost.rows // (d * f)
        if p == 1:
            layouts = [(m, "1f1b", 1) for m in _accumulation(rows, grad_accum)]
        else:
            layouts = [(m, kind, v) for m in pipeline_microbatches(p, rows, opts.microbatches)
                       for kind, v in _schedules(p, m, blocks, opts)]
        if not layouts:
            result.dropped["batch too small for the microbatches"] += 1
            continue
        for m, kind, v in layouts:
            for remat in remats:
                layout = Layout(tuple(sizes.items()), remat, m, kind, v)
                pred = predict(ctx, layout)
                fits = bool(pred.per_device_bytes <= ctx.memory_limit)
                remat_ok = configured_remat is None or remat == configured_remat
                blockers = [] if remat_ok else [f"needs model.remat={remat!r}"]
                if p == 1 and m != grad_accum:
                    blockers.append(f"needs train.microbatches={m}")
                if p > 1 and not opts.runnable:
                    blockers.append(opts.why_not)
                result.ranked.append(Candidate(layout, pred, fits, tuple(blockers)))
                if fits and remat_ok:
                    break
    result.ranked.sort(key=lambda c: (not c.fits, c.prediction.step_time_s,
                                      c.prediction.per_device_bytes, len(c.blockers)))
    return result


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
    """``"remat full, 1f1b, 64 mb"``: a layout's settings besides its mesh."""
    parts = [f"remat {layout.remat}"]
    if layout.sizes["stage"] > 1:
        parts.append(layout.schedule + (f" x{layout.virtual}" if layout.virtual > 1 else ""))
    parts.append(f"{layout.microbatches} mb")
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
