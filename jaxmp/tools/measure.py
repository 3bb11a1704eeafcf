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
from jaxmp.hlo.branches import one_branch_bytes, tick_busy_fraction
from jaxmp.hlo.executed import executed_bytes, module_name, trace_counts
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
    executor, busy = trainer.executor, None
    if executor is not None:  # the ticks' conditionals: charged on the ticks that run them
        s = executor.schedule
        busy = tick_busy_fraction(s.microbatches, s.virtual, executor.program.ticks)
    return Measured(argument_bytes=float(mem.argument_size_in_bytes),
                    temp_bytes=float(mem.temp_size_in_bytes), collectives=stats,
                    one_branch=one_branch_bytes(stats, compiled, busy), compiled=compiled)


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
