"""The planner's front door: a :class:`Plan` for a model's costs on a number of devices.

``plan(cost, n_devices, profile)`` enumerates every factorisation data × stage × fsdp × tensor
of the devices, predicts memory and step time for each (:mod:`jaxmp.plan.predict`), drops the
ones that do not fit, and returns the fastest runnable layout, its per-parameter partition
specs, stage ranges and predictions, and the ranked alternatives with the reason each lost.
:func:`plan_for_config` does the same with a run's config sections (fixed mesh axes, device
profile, gradient accumulation); the Trainer and ``jaxmp plan`` both go through it.

The planner knows no model and no trainer: a model reaches it only as a
:class:`~jaxmp.cost.ModelCost`. Layers (and stage ranges) index that cost table: ``pre`` (the
embedding), each block, other top-level modules, ``post`` (head and loss); ranges are half-open
``[start, end)``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from jaxmp import sharding
from jaxmp.config import TrainerConfig
from jaxmp.cost import ModelCost
from jaxmp.devices import DeviceProfile, profile_from_config
from jaxmp.errors import PlanError
from jaxmp.parallel.reduce import Compression
from jaxmp.plan.predict import Context, Prediction
from jaxmp.plan.search import PIPELINE_NOTE, Candidate, choose, reason_lost, search


@dataclass
class Plan:
    """A chosen layout with its predictions and the alternatives it beat."""

    mesh: dict[str, int]
    remat: str
    microbatches: int
    stages: list[tuple[int, int]]
    predicted: Prediction
    fits: bool
    runnable: bool
    rules: tuple
    param_specs: dict[str, list]
    layers: list[dict]
    alternatives: list[dict]
    dropped: dict[str, int]
    device: DeviceProfile
    n_devices: int
    memory_limit: float
    planning_time_s: float
    cost_time_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    verify: dict | None = None

    def to_json(self) -> dict[str, Any]:
        """The plan as plain JSON values (what ``plan.json`` and ``jaxmp plan --json`` hold)."""
        out = {"mesh": dict(self.mesh), "stages": [list(s) for s in self.stages],
               "remat": self.remat, "microbatches": self.microbatches,
               "status": "runnable" if self.runnable else PIPELINE_NOTE
               if self.mesh.get("stage", 1) > 1 else "not runnable as configured",
               "fits": self.fits, "predicted": self.predicted.to_dict(),
               "memory_limit_bytes": self.memory_limit, "n_devices": self.n_devices,
               "device": self.device.to_dict(),
               "rules": [[name, list(axes) if isinstance(axes, tuple) else axes]
                         for name, axes in self.rules],
               "param_specs": self.param_specs, "layers": self.layers,
               "alternatives": self.alternatives, "dropped": self.dropped,
               "notes": list(self.notes), "planning_time_s": self.planning_time_s,
               "cost_time_s": self.cost_time_s}
        if self.verify is not None:
            out["verify"] = self.verify
        return out


def _alternative(c: Candidate, best: Candidate, limit: float) -> dict[str, Any]:
    p = c.prediction
    return {"mesh": c.mesh, "stages": [list(s) for s in p.stages], "remat": c.layout.remat,
            "microbatches": c.layout.microbatches, "fits": c.fits, "runnable": c.runnable,
            "predicted": {"per_device_bytes": p.per_device_bytes,
                          "step_time_s": p.step_time_s, "flops_per_step": p.flops_per_step,
                          "comm_bytes_per_step": p.comm_bytes_per_step,
                          "bubble_s": p.bubble_s},
            "reason": reason_lost(c, best, limit)}


def _param_specs(cost: ModelCost, mesh: Mapping[str, int], rules: Sequence) -> dict[str, list]:
    sizes = {**mesh, "stage": 1}  # stages split layers by range, not by a param dim
    out: dict[str, list] = {}
    for lay in cost.layers:
        for leaf in lay.params:
            if leaf.path not in out:
                spec = sharding.resolve(leaf.names, leaf.shape, sizes, rules).spec \
                    if leaf.names is not None else ()
                out[leaf.path] = [list(e) if isinstance(e, tuple) else e for e in spec]
    return out


def plan(cost: ModelCost, n_devices: int, profile: DeviceProfile,
         rules: Sequence | None = None, fixed: Mapping[str, int] | None = None,
         remats: Sequence[str] | None = None, grad_accum: int = 1,
         configured_remat: str | None = None, top: int = 8,
         grad_compression: Compression | None = None) -> Plan:
    """Plan ``cost`` (from :func:`jaxmp.cost.model_costs`) on ``n_devices`` of ``profile``.

    ``fixed`` holds axis sizes the user set (constraints); ``remats`` the policies to consider
    (default: those costed); ``configured_remat`` / ``grad_accum`` what the trainer will run
    (other values are ranked but marked not runnable).
    """
    if n_devices < 1:
        raise PlanError(f"the device count must be >= 1, got {n_devices}")
    rules = sharding.normalize_rules(rules or sharding.DEFAULT_RULES)
    start = time.perf_counter()
    ctx = Context(cost, profile, n_devices, rules, grad_compression)
    try:
        result = search(ctx, fixed, remats, grad_accum, configured_remat)
    except ValueError as e:
        raise PlanError(str(e)) from None
    best, notes = choose(result)
    if best is None:
        why = ", ".join(f"{k} ({v})" for k, v in result.dropped.items()) or "none enumerated"
        raise PlanError(f"no layout of {n_devices} devices is possible with mesh constraints "
                        f"{dict(fixed or {})}: {why}")
    alternatives = [_alternative(c, best, ctx.memory_limit)
                    for c in result.ranked if c is not best][:top]
    return Plan(mesh=best.mesh, remat=best.layout.remat, microbatches=best.layout.microbatches,
                stages=best.prediction.stages, predicted=best.prediction, fits=best.fits,
                runnable=best.runnable, rules=rules, param_specs=_param_specs(cost, best.mesh, rules),
                layers=[lay.to_dict() for lay in cost.layers], alternatives=alternatives,
                dropped=dict(result.dropped), device=profile, n_devices=n_devices,
                memory_limit=ctx.memory_limit, planning_time_s=time.perf_counter() - start,
                notes=notes + list(cost.warnings))


def plan_for_config(config: TrainerConfig, cost: ModelCost, n_devices: int, *,
                    rules: Sequence | None = None, device_kind: str | None = None,
                    remats: Sequence[str] | None = None, strict: bool = False,
                    measure_cpu: bool = False) -> Plan:
    """Plan ``cost`` as a run's config asks: its explicit mesh axes are fixed, its ``[device]``
    section describes the devices, its ``train.grad_accum`` and the model's own remat policy
    (``cost.runs_as``) are what can run.

    ``remats`` are the policies to rank (default: only the runnable one). The Trainer keeps
    the defaults ``strict=False`` (an unknown device kind describes itself) and
    ``measure_cpu=False``: every process of a multi-host run must reach the same plan, so no
    measured number may enter it. ``jaxmp plan`` passes ``strict=True, measure_cpu=True``.
    """
    fixed = {a: v for a, v in config.mesh.explicit().items() if v != -1}
    profile = profile_from_config(config.device, device_kind, strict=strict,
                                  measure_cpu=measure_cpu)
    return plan(cost, n_devices, profile, rules=rules, fixed=fixed,
                remats=tuple(remats) if remats else (cost.runs_as,),
                grad_accum=config.train.grad_accum, configured_remat=cost.runs_as,
                grad_compression=Compression.from_config(config.train))
