"""What ``jaxmp bench`` reports: one :class:`Row` per strategy, the :class:`Bench` around them,
and the planner's prediction beside each row with the relative error of each figure.

Kept apart from the measuring (:mod:`jaxmp.tools.bench`) so the output side
(:mod:`jaxmp.tools.bench_output`, charts, tests) reads results without the step machinery.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from jaxmp.plan import Plan
from jaxmp.tools.measure import rel_err

# The measured figures that have a predicted counterpart (rel_err = predicted/measured - 1).
COMPARED = ("argument_bytes", "temp_bytes", "peak_bytes", "collective_bytes_total",
            "step_time_s", "tokens_per_s", "mfu")


@dataclass
class Row:
    """One strategy's result; measured fields stay None when it did not run that far."""

    name: str
    mesh: dict[str, int] | None = None
    status: str = "ok"  # "ok" | "not run" | "compiled only"
    reason: str = ""
    same_as: str = ""  # an earlier row with the same mesh: its measurement, not repeated
    argument_bytes: float | None = None
    temp_bytes: float | None = None
    peak_bytes: float | None = None
    collective_bytes: dict[str, float] | None = None
    collective_bytes_raw: float | None = None  # as compiled (CPU keeps all-reduce + slice)
    collective_bytes_static: float | None = None  # conditionals charged their largest branch
    collectives_from: str = ""  # "executed" (a profiled step) | "static"
    layout: dict[str, Any] | None = None  # the plan's layout, as the Trainer built it
    compile_s: float | None = None
    step_times_s: list[float] = field(default_factory=list)
    tokens_per_s: float | None = None
    model_flops_per_s: float | None = None
    mfu: float | None = None
    loss: float | None = None
    predicted: dict[str, Any] | None = None
    # XLA's rematerialization estimate when it warned (--aot): information beside the fit
    # verdict, which is the compiled peak's (docs/planner.md §7)
    xla_rematerialization: dict[str, float] | None = None

    @property
    def step_time_s(self) -> float | None:
        return statistics.median(self.step_times_s) if self.step_times_s else None

    @property
    def collective_bytes_total(self) -> float | None:
        return sum(self.collective_bytes.values()) if self.collective_bytes else None

    def to_json(self) -> dict[str, Any]:
        t = self.step_times_s
        return {"name": self.name, "mesh": self.mesh, "status": self.status,
                "reason": self.reason or None, "same_as": self.same_as or None,
                "argument_bytes": self.argument_bytes, "temp_bytes": self.temp_bytes,
                "peak_bytes": self.peak_bytes, "collective_bytes": self.collective_bytes,
                "collective_bytes_total": self.collective_bytes_total,
                "collective_bytes_raw": self.collective_bytes_raw,
                "collective_bytes_static": self.collective_bytes_static,
                "collectives_from": self.collectives_from or None, "layout": self.layout,
                "compile_s": self.compile_s, "step_time_s": self.step_time_s,
                "step_time_min_s": min(t) if t else None,
                "step_time_max_s": max(t) if t else None,
                "tokens_per_s": self.tokens_per_s, "model_flops_per_s": self.model_flops_per_s,
                "mfu": self.mfu, "loss": self.loss, "predicted": self.predicted,
                "xla_rematerialization": self.xla_rematerialization}


@dataclass
class Bench:
    """Every row, and what they share: devices, batch, model FLOPs, the peak behind MFU."""

    rows: list[Row]
    n_devices: int
    platform: str
    device_kind: str
    peak_flops: float  # all devices together (CPU: the host's measured matmul rate)
    tokens_per_step: int
    model_flops_per_step: float
    steps: int
    warmup: int
    param_bytes: float
    description: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"strategies": [r.to_json() for r in self.rows], "devices": self.n_devices,
                "platform": self.platform, "device_kind": self.device_kind,
                "peak_flops": self.peak_flops, "tokens_per_step": self.tokens_per_step,
                "model_flops_per_step": self.model_flops_per_step, "steps": self.steps,
                "warmup": self.warmup, "param_bytes": self.param_bytes, **self.description}


def predicted_row(plan: Plan, tokens: int, model_flops: float, peak: float) -> dict | None:
    p = plan.predicted
    if p is None:
        return None
    step = p.step_time_s
    return {"argument_bytes": p.argument_bytes, "temp_bytes": p.per_device_bytes - p.argument_bytes,
            "peak_bytes": p.per_device_bytes, "collective_bytes_total": p.comm_bytes_per_step,
            "collective_bytes_by_axis": {a: v for a, v in p.comm_bytes.items() if v},
            "step_time_s": step, "tokens_per_s": tokens / step if step else None,
            "mfu": model_flops / step / peak if step else None, "fits": plan.fits,
            "stages": [list(s) for s in p.stages], "microbatches": plan.microbatches,
            "remat": plan.remat, "schedule": plan.schedule, "virtual_stages": plan.virtual}


def with_errors(row: Row) -> None:
    if row.predicted is None:
        return
    errs = {}
    for key in COMPARED:
        measured, predicted = getattr(row, key), row.predicted.get(key)
        if measured is not None and predicted is not None:
            errs[key] = rel_err(predicted, measured)
    row.predicted["rel_err"] = errs
