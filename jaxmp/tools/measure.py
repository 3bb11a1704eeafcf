"""Compile a Trainer's step and read what the compiled program says about itself; run it once
under the profiler to read what it executed.

Memory from ``memory_analysis()`` (a conditional's temporaries are its largest branch's),
collectives from the optimized HLO (:func:`jaxmp.hlo.collective_stats`; with conditionals,
each charged its largest branch: :mod:`jaxmp.hlo.branches`), FLOPs from ``cost_analysis()``.
The step is the Trainer's own (``Trainer.compile``), so what is measured is what ``jaxmp train``
would run. :func:`executed_collectives` counts what one step executed, per device
(:mod:`jaxmp.hlo.executed`: on the CPU backend, from a profiler trace).
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from typing import Any

import jax

from jaxmp.hlo import CollectiveStats, collective_stats
from jaxmp.hlo.branches import TickDevice, one_branch_bytes
from jaxmp.hlo.executed import executed_bytes, module_name, trace_counts
from jaxmp.pipeline.chunk import FIRST_CHUNK, LAST_CHUNK
from jaxmp.pipeline.schedule import Program, Schedule
from jaxmp.pipeline.ticks import BACKWARD_TICK, FORWARD_TICK
from jaxmp.train import Trainer


@dataclass
class Measured:
    """Per-device numbers of one compiled train step."""

    argument_bytes: float
    temp_bytes: float
    collectives: CollectiveStats
    one_branch: dict[str, float] = field(default_factory=dict)  # by kind, conditionals' max
    compiled: Any = field(repr=False, default=None)

    @property
    def peak_bytes(self) -> float:
        """Arguments plus temporaries: what must fit in device memory during a step."""
        return self.argument_bytes + self.temp_bytes

    @property
    def collective_bytes(self) -> float:
        """Bytes one device sends per step: every conditional charged its largest branch
        (equal to the plain count for programs without one); a pipeline tick's, on the ticks
        that run it (:func:`jaxmp.hlo.branches.one_branch_bytes`)."""
        return sum(self.one_branch.values())


def rel_err(predicted: float, measured: float) -> float:
    """Signed relative error of a prediction: ``predicted / measured - 1`` (0 when both are 0)."""
    if measured:
        return float(predicted) / float(measured) - 1.0
    return 0.0 if not predicted else float("inf")


def measure_step(trainer: Trainer, batch: Any = None) -> Measured:
    """Compile ``trainer``'s train step and measure it (``batch``: default its example batch)."""
    compiled = trainer.compile(batch)
    mem = compiled.memory_analysis()
    stats = collective_stats(compiled)
    executor = trainer.executor
    devices = tick_devices(executor.program, executor.schedule) if executor is not None else []
    return Measured(argument_bytes=float(mem.argument_size_in_bytes),
                    temp_bytes=float(mem.temp_size_in_bytes), collectives=stats,
                    one_branch=one_branch_bytes(stats, compiled, devices,
                                                frozenset({FIRST_CHUNK, LAST_CHUNK})),
                    compiled=compiled)


def tick_devices(program: Program, schedule: Schedule) -> list[TickDevice]:
    """Each pipeline device's ticks as :func:`one_branch_bytes` charges them: the share of
    ticks its forward and its backward conditional run (a folded last chunk's forward runs in
    its backward), and the chunk-only work it holds (chunk ``v·P + device``: the first on
    device 0, the last on device ``P-1``)."""
    ticks, p = program.f_mb.shape
    out = []
    for d in range(p):
        held = {FIRST_CHUNK} if d == 0 else set()
        held |= {LAST_CHUNK} if d == p - 1 else set()
        busy = {FORWARD_TICK: float((program.f_mb[:, d] >= 0).sum()) / ticks,
                BACKWARD_TICK: float((program.b_mb[:, d] >= 0).sum()) / ticks}
        out.append(TickDevice(busy, frozenset(held), schedule.virtual))
    return out


def executed_collectives(measured: Measured, state: Any, batch: Any
                         ) -> tuple[Any, dict[str, float] | None]:
    """Run ``measured``'s step once on ``state`` and ``batch`` under the profiler: (the new
    state, the bytes by kind the busiest device executed — None where the backend records no
    per-instruction events)."""
    text = measured.compiled.as_text()
    with tempfile.TemporaryDirectory(prefix="jaxmp-trace-") as tmp:
        jax.profiler.start_trace(tmp)
        try:
            state, metrics = measured.compiled(state, batch)
            jax.block_until_ready((state, metrics))
        finally:
            jax.profiler.stop_trace()
        counts = trace_counts(tmp, module_name(text))
    return state, executed_bytes(measured.collectives, counts)
