"""What a pipelined step holds and where its layers sit, in closed form, for the planner.

The executor (:mod:`jaxmp.pipeline.executor`) runs :meth:`Schedule.program`, whose buffers are as
wide as the busiest device needs: every device allocates the same slots (one SPMD program), plus
one spare slot that idle ticks write to. Building the program is O(ticks x devices) in Python,
too slow for a planner that weighs thousands of layouts, so the slot counts are given here in
closed form (tested equal to the program's over a grid of schedules).

The pipeline's layer table is the cost model's with everything before the layer stack folded
into ``pre`` and everything after it into ``post`` (:func:`stack_span`); a chunk of that table
maps back to a contiguous range of the cost model's layers (:func:`chunk_ranges`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from jaxmp.pipeline.schedule import Schedule
from jaxmp.pipeline.stages import StageSplit


@dataclass(frozen=True)
class Slots:
    """Buffer slots of the executor's program (without the spare one)."""

    act: int  # chunk inputs received (and, folded, the last chunk's input kept)
    res: int  # stashed forward residuals: the microbatch-chunks in flight on device 0
    ct: int  # cotangents received


def buffer_slots(schedule: Schedule) -> Slots:
    """The slots :meth:`Schedule.program` assigns, without simulating the table."""
    if schedule.stages == 1:
        return Slots(act=1, res=schedule.microbatches, ct=1)
    return Slots(act=2, res=schedule.in_flight(0),
                 ct=2 if schedule.kind == "interleaved" else 1)


def stack_span(kinds: Sequence[str], groups: Sequence[str]) -> tuple[int, int] | None:
    """``(lo, hi)``: the half-open range of the layer stack's blocks in a per-layer table
    (the group with the most ``block`` layers), or None when the model has no stack."""
    counts = Counter(g for k, g in zip(kinds, groups) if k == "block")
    if not counts:
        return None
    stack = counts.most_common(1)[0][0]
    idx = [i for i, (k, g) in enumerate(zip(kinds, groups)) if k == "block" and g == stack]
    return idx[0], idx[-1] + 1


def fold(values: Sequence[float], span: tuple[int, int]) -> list[float]:
    """Per-layer ``values`` as the pipeline's table: ``[pre, block, ..., block, post]``."""
    lo, hi = span
    return [float(sum(values[:lo]))] + [float(v) for v in values[lo:hi]] + \
        [float(sum(values[hi:]))]


def chunk_ranges(split: StageSplit, span: tuple[int, int], n_layers: int
                 ) -> list[tuple[int, int]]:
    """Each chunk of ``split`` (bounds over the folded table) as a half-open range of the
    unfolded per-layer table of ``n_layers`` layers."""
    lo, _ = span

    def start(i: int) -> int:  # folded index -> first unfolded layer
        if i == 0:
            return 0
        if i >= split.n_blocks + 2:
            return n_layers
        return lo + i - 1

    return [(start(a), start(b)) for a, b in split.bounds]
