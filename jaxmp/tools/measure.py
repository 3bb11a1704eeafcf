"""Compile a Trainer's step and read what the compiled program says about itself.

Memory from ``memory_analysis()``, collectives from the optimized HLO
(:func:`jaxmp.hlo.collective_stats`), FLOPs from ``cost_analysis()``. The step is the Trainer's
own (``Trainer.compile``), so what is measured is what ``jaxmp train`` would run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from jaxmp.hlo import CollectiveStats, collective_stats
from jaxmp.train import Trainer


@dataclass
class Measured:
    """Per-device numbers of one compiled train step."""

    argument_bytes: float
    temp_bytes: float
    collectives: CollectiveStats
    compiled: Any = field(repr=False, default=None)

    @property
    def peak_bytes(self) -> float:
        """Arguments plus temporaries: what must fit in device memory during a step."""
        return self.argument_bytes + self.temp_bytes


def rel_err(predicted: float, measured: float) -> float:
    """Signed relative error of a prediction: ``predicted / measured - 1`` (0 when both are 0)."""
    if measured:
        return float(predicted) / float(measured) - 1.0
    return 0.0 if not predicted else float("inf")


def measure_step(trainer: Trainer, batch: Any = None) -> Measured:
    """Compile ``trainer``'s train step and measure it (``batch``: default its example batch)."""
    compiled = trainer.compile(batch)
    mem = compiled.memory_analysis()
    return Measured(argument_bytes=float(mem.argument_size_in_bytes),
                    temp_bytes=float(mem.temp_size_in_bytes),
                    collectives=collective_stats(compiled), compiled=compiled)
