"""Split a sequence of layers into contiguous pipeline stages, minimising the slowest stage.

Exact, by binary search over the answer: the optimal bottleneck is one of the O(n²) contiguous
segment sums, and for a candidate bottleneck T a greedy left-to-right packing (extend the
current stage while its cost stays <= T and its memory <= the limit) uses the fewest stages
possible, because both constraints only get harder as a stage grows. If the fewest is <= the
number of stages wanted, splitting stages further keeps every constraint, so T is feasible.
O(n² log n) for the candidate sort, O(n log n) per search: a 96-layer model balances in
milliseconds, which matters because the planner balances once per (stage count, remat) pair.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

import numpy as np


class InfeasibleError(ValueError):
    """No contiguous split satisfies the request (too many stages, or memory too tight)."""


_SLACK = 1e-9  # relative: segment sums from prefix differences carry rounding error


def _greedy(pc: list[float], pm: list[float], limit_t: float,
            limit_m: float) -> list[int] | None:
    """Start indices of the fewest stages with cost <= limit_t and memory <= limit_m each.

    ``pc``/``pm`` are prefix sums (length n + 1) of non-negative costs / memory, so a stage
    starting at i extends to the last j with pc[j] - pc[i] <= limit (a binary search each).
    """
    n = len(pc) - 1
    tol_t = limit_t * _SLACK + 1e-300
    tol_m = (limit_m * _SLACK if math.isfinite(limit_m) else 0.0) + 1e-300
    starts, i = [], 0
    while i < n:
        j = min(bisect.bisect_right(pc, pc[i] + limit_t + tol_t),
                bisect.bisect_right(pm, pm[i] + limit_m + tol_m)) - 1
        if j <= i:
            return None  # one layer alone is over a limit
        starts.append(i)
        i = j
    return starts


def _split_to(starts: list[int], n: int, k: int, costs: Sequence[float]) -> list[int]:
    """Add stage boundaries until there are exactly ``k`` stages (each split keeps feasibility).

    Splits the stage with the highest cost (ties: the longest) at its cost midpoint, so extra
    stages also lower the cost of the heaviest ones.
    """
    starts = list(starts)
    while len(starts) < k:
        bounds = list(zip(starts, starts[1:] + [n]))
        splittable = [(sum(costs[a:b]), b - a, a, b) for a, b in bounds if b - a > 1]
        _, _, a, b = max(splittable)
        prefix, half, best = 0.0, sum(costs[a:b]) / 2, a + 1
        for i in range(a, b - 1):
            prefix += costs[i]
            if prefix >= half:
                best = i + 1
                break
        bisect.insort(starts, max(a + 1, min(best, b - 1)))
    return starts


def balance_stages(costs: Sequence[float], n_stages: int, memory_limit: float | None = None,
                   memory: Sequence[float] | None = None) -> list[tuple[int, int]]:
    """Contiguous half-open layer ranges ``[(start, end), ...]``, one per stage, minimising the
    largest per-stage sum of ``costs``; with ``memory_limit`` every stage's sum of ``memory``
    (default: ``costs``) must also stay within it.

    Raises :class:`InfeasibleError` when there are fewer layers than stages or no split fits.
    """
    costs = [float(c) for c in costs]
    n = len(costs)
    if n_stages < 1:
        raise InfeasibleError(f"n_stages must be >= 1, got {n_stages}")
    if n < n_stages:
        raise InfeasibleError(f"cannot split {n} layers into {n_stages} non-empty stages")
    if any(c < 0 for c in costs):
        raise InfeasibleError("layer costs must be >= 0")
    mem = [float(m) for m in memory] if memory is not None else costs
    if len(mem) != n:
        raise InfeasibleError(f"{len(mem)} memory values for {n} layers")
    limit_m = float("inf") if memory_limit is None else float(memory_limit)
    pc_np = np.concatenate([[0.0], np.cumsum(costs)])
    pc, pm = pc_np.tolist(), np.concatenate([[0.0], np.cumsum(mem)]).tolist()

    def count(limit_t: float) -> float:
        starts = _greedy(pc, pm, limit_t, limit_m)
        return float("inf") if starts is None else len(starts)

    if count(pc[-1]) > n_stages:  # memory alone needs more stages, whatever the cost bound
        raise InfeasibleError(f"no split of {n} layers into {n_stages} stages keeps each "
                              f"stage's memory within {memory_limit:.4g}")
    # Without memory limits the optimum lies in [low, low + max(c)] with low = max(max(c),
    # total/k): a stage closes only when the next layer would pass the bound. Search only the
    # segment sums there, unless memory makes even the upper end infeasible.
    low = max(max(costs), pc[-1] / n_stages)
    high = low + max(costs)
    if count(high) <= n_stages:
        candidates = _segment_sums(pc_np, low * (1 - _SLACK), high * (1 + _SLACK) + 1e-300)
    else:
        candidates = _segment_sums(pc_np, high * (1 - _SLACK), float("inf"))

    lo, hi = 0, len(candidates) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if count(candidates[mid]) <= n_stages:
            hi = mid
        else:
            lo = mid + 1
    starts = _greedy(pc, pm, candidates[lo], limit_m)
    assert starts is not None
    starts = _split_to(starts, n, n_stages, costs)
    return list(zip(starts, starts[1:] + [n]))


def _segment_sums(pc: np.ndarray, low: float, high: float) -> np.ndarray:
    """Sorted distinct segment sums pc[j] - pc[i] (i < j) within [low, high]."""
    sums = pc[None, :] - pc[:, None]  # [i, j]: sum of layers i..j-1
    sums = sums[np.triu_indices(len(pc), 1)]
    sums = np.unique(sums[(sums >= low) & (sums <= high)])
    return sums if len(sums) else np.array([pc[-1] - pc[0]])


def stage_sums(values: Sequence[float], stages: Sequence[tuple[int, int]]) -> list[float]:
    """Per-stage sums of a per-layer quantity."""
    return [float(sum(values[a:b])) for a, b in stages]
