"""Enumerate layouts (mesh factorisation × remat × microbatches), predict each, rank them.

Every factorisation data × stage × fsdp × tensor of the device count is considered, subject to
the user's fixed axes, and dropped only for a stated reason: the batch does not split evenly,
an axis would shard nothing (tensor on dims it does not divide, fsdp on nothing), more stages
than layers, or the stages cannot be balanced within memory. The rest are predicted
(:mod:`jaxmp.plan.predict`) and ranked: those that fit first, fastest first.

A plan is *runnable* when the trainer can execute it as configured: no pipeline stages (jaxmp
does not execute them yet), and the configured remat policy and gradient accumulation. Others are
still ranked and shown, with what they would need.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from jaxmp._util.fmt import fmt_bytes, fmt_time
from jaxmp.mesh import AXES
from jaxmp.parallel.balance import InfeasibleError
from jaxmp.plan.predict import Context, Layout, Prediction, predict

PIPELINE_NOTE = "predicted only: jaxmp does not execute pipeline stages yet"


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


def _microbatches(p: int, rows_per_replica: int, grad_accum: int) -> list[int]:
    base = p if p > 1 else grad_accum
    return [m for m in (base, 2 * base, 4 * base) if rows_per_replica % m == 0]


def search(ctx: Context, fixed: Mapping[str, int] | None = None,
           remats: Sequence[str] | None = None, grad_accum: int = 1,
           configured_remat: str | None = None) -> SearchResult:
    """Predict and rank every allowed layout for ``ctx``'s model and device count."""
    cost, n = ctx.cost, ctx.n
    remats = list(remats or next(iter(cost.layers)).saved)
    n_layers = len(cost.layers)
    result = SearchResult([])
    unknown = set(fixed or {}) - set(AXES)
    if unknown:
        raise ValueError(f"unknown mesh axis {sorted(unknown)[0]!r}")
    for sizes in factorisations(n, fixed):
        d, p, f, t = (sizes[a] for a in AXES)
        if cost.rows % (d * f):
            result.dropped[f"batch {cost.rows} not divisible by data x fsdp"] += 1
            continue
        if p > n_layers:
            result.dropped["more stages than layers"] += 1
            continue
        if t > 1 and not any(ctx.shard(i, f, t).tensor_weights for i in ctx.first):
            result.dropped["tensor splits no weight (dims not divisible)"] += 1
            continue
        if f > 1 and not any(ctx.shard(i, f, 1).gathered > ctx.shard(i, f, 1).local
                             for i in ctx.first):
            result.dropped["fsdp shards no weight (dims not divisible)"] += 1
            continue
        micro = _microbatches(p, cost.rows // (d * f), grad_accum)
        if not micro:
            result.dropped["batch too small for the microbatches"] += 1
            continue
        for remat in remats:
            for m in micro:
                layout = Layout(tuple(sizes.items()), remat, m)
                try:
                    pred = predict(ctx, layout)
                except InfeasibleError:
                    result.dropped["stages cannot be balanced within memory"] += 1
                    continue
                blockers = []
                if p > 1:
                    blockers.append(PIPELINE_NOTE)
                if configured_remat is not None and remat != configured_remat:
                    blockers.append(f"needs model.remat={remat!r}")
                if p == 1 and m != grad_accum:
                    blockers.append(f"needs train.grad_accum={m}")
                result.ranked.append(Candidate(layout, pred,
                                               pred.per_device_bytes <= ctx.memory_limit,
                                               tuple(blockers)))
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
    return None, ["no runnable plan (every candidate needs pipeline stages or other settings)"]


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
