"""The planner's front door: a :class:`Plan` for a model's costs on a number of devices.

``plan(cost, n_devices, profile)`` enumerates every factorisation data × stage × fsdp × tensor
of the devices, with remat policies, microbatches and pipeline schedules, predicts memory and
step time for each (:mod:`jaxmp.plan.predict`), and returns the fastest runnable layout that
fits, its per-parameter partition specs, stage ranges and predictions, and the ranked
alternatives with the reason each lost. When nothing fits it says how many devices of the kind
would be needed. :func:`plan_for_config` does the same with a run's config sections (fixed mesh
axes, device profile, remat, gradient accumulation, pipeline settings); the Trainer and
``jaxmp plan`` both go through it.

The planner knows no model and no trainer: a model reaches it only as a
:class:`~jaxmp.cost.ModelCost`. Layers (and stage ranges) index that cost table: ``pre`` (the
embedding), each block, other top-level modules, ``post`` (head and loss); ranges are half-open
``[start, end)``; with pipeline stages there is one range per chunk, chunk ``c`` on stage
``c % stages``.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from jaxmp import sharding
from jaxmp._util.fmt import fmt_bytes, mesh_str
from jaxmp.compression.reduce import Compression
from jaxmp.config import TrainerConfig
from jaxmp.cost import ModelCost
from jaxmp.devices import DeviceProfile, profile_from_config
from jaxmp.errors import PlanError
from jaxmp.plan.context import Context, Prediction
from jaxmp.plan.search import (Candidate, PipelineOptions, SearchResult, choose, describe,
                               reason_lost, search)

MAX_DOUBLINGS = 10  # how far "devices needed" looks: up to 1024x the devices given


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
    schedule: str = ""  # with stages: the pipeline schedule and its chunks per device
    virtual: int = 1
    blockers: list[str] = field(default_factory=list)
    devices_needed: int | None = None  # when nothing fits: devices of this kind that would do
    candidates: list[Candidate] = field(default_factory=list, repr=False)  # ranked, all
    _search_args: dict = field(default_factory=dict, repr=False)

    def to_json(self) -> dict[str, Any]:
        """The plan as plain JSON values (what ``plan.json`` and ``jaxmp plan --json`` hold)."""
        out = {"mesh": dict(self.mesh), "stages": [list(s) for s in self.stages],
               "remat": self.remat, "microbatches": self.microbatches,
               "schedule": self.schedule, "virtual_stages": self.virtual,
               "status": "runnable" if self.runnable else
               "not runnable: " + "; ".join(self.blockers),
               "fits": self.fits, "predicted": self.predicted.to_dict(),
               "memory_limit_bytes": self.memory_limit, "n_devices": self.n_devices,
               "devices_needed": self.devices_needed, "device": self.device.to_dict(),
               "rules": [[name, list(axes) if isinstance(axes, tuple) else axes]
                         for name, axes in self.rules],
               "param_specs": self.param_specs, "layers": self.layers,
               "alternatives": self.alternatives, "dropped": self.dropped,
               "notes": list(self.notes), "planning_time_s": self.planning_time_s,
               "cost_time_s": self.cost_time_s}
        if self.verify is not None:
            out["verify"] = self.verify
        return out

    def compare(self, given: Mapping[str, Any]) -> Candidate:
        """The best layout with the ``given`` mesh axes (others 1) and, if given, ``remat``,
        ``schedule``, ``virtual`` and ``microbatches``, predicted like every candidate — what
        ``jaxmp plan --compare`` prints beside the chosen plan. Settings that fit and run as
        configured are preferred, then settings that fit. Bad keys or an impossible layout
        raise :class:`PlanError`."""
        given = dict(given)
        bad = sorted(set(given) - set(COMPARE_KEYS))
        if bad:
            raise PlanError(f"--compare: unknown key {bad[0]!r} (keys: {', '.join(COMPARE_KEYS)})")
        mesh = {a: int(given.pop(a, 1)) for a in ("data", "stage", "fsdp", "tensor")}
        args = self._search_args
        kw = dict(args["kw"], fixed=mesh)
        if "remat" in given:
            kw["remats"] = (given["remat"],)
        kw["pipeline"] = dataclasses.replace(
            kw["pipeline"] or PipelineOptions(),
            **{k: given[k] if k == "schedule" or given[k] == "auto" else int(given[k])
               for k in ("schedule", "virtual", "microbatches") if k in given})
        if mesh["stage"] == 1 and "microbatches" in given:
            kw["grad_accum"] = int(given["microbatches"])
        _, result = _search(args["cost"], self.n_devices, self.device, self.rules, kw)
        if not result.ranked:
            why = ", ".join(f"{k} ({v})" for k, v in result.dropped.items()) or "no candidate"
            raise PlanError(f"--compare: {mesh_str(mesh)} is not a layout of {self.n_devices} "
                            f"devices for this model: {why}")
        ranked = result.ranked  # fitting first: prefer what fits, then what runs as configured
        return next((c for c in ranked if c.fits and c.runnable), None) or ranked[0]


COMPARE_KEYS = ("data", "stage", "fsdp", "tensor", "remat", "schedule", "virtual",
                "microbatches")


def _alternative(c: Candidate, best: Candidate, limit: float) -> dict[str, Any]:
    p = c.prediction
    return {"mesh": c.mesh, "stages": [list(s) for s in p.stages], "remat": c.layout.remat,
            "microbatches": c.layout.microbatches, "schedule": p.schedule,
            "virtual_stages": p.virtual, "settings": describe(c.layout), "fits": c.fits,
            "runnable": c.runnable,
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


def _search(cost: ModelCost, n: int, profile: DeviceProfile, rules: Sequence, kw: dict
            ) -> tuple[Context, SearchResult]:
    ctx = Context(cost, profile, n, rules, balance=kw.pop("balance"),
                  grad_compression=kw.pop("grad_compression", None))
    try:
        return ctx, search(ctx, **kw)
    except ValueError as e:
        raise PlanError(str(e)) from None


def devices_needed(cost: ModelCost, n_devices: int, profile: DeviceProfile, rules: Sequence,
                   kw: dict) -> tuple[int, Candidate] | None:
    """The fewest devices of ``profile`` (``n_devices`` doubled) on which a runnable plan
    fits, with that plan; None past ``MAX_DOUBLINGS``. The user's fixed axes are dropped."""
    kw = dict(kw, fixed=None)
    for k in range(1, MAX_DOUBLINGS + 1):
        n = n_devices * 2**k
        _, result = _search(cost, n, profile, rules, dict(kw))
        fitting = [c for c in result.ranked if c.runnable and c.fits]
        if fitting:
            return n, fitting[0]
    return None


def plan(cost: ModelCost, n_devices: int, profile: DeviceProfile,
         rules: Sequence | None = None, fixed: Mapping[str, int] | None = None,
         remats: Sequence[str] | None = None, grad_accum: int = 1,
         configured_remat: str | None = None, top: int = 8,
         pipeline: PipelineOptions | None = None, balance: str = "flops",
         grad_compression: Compression | None = None) -> Plan:
    """Plan ``cost`` (from :func:`jaxmp.cost.model_costs`) on ``n_devices`` of ``profile``.

    ``fixed`` holds axis sizes the user set (constraints); ``remats`` the policies to consider
    (default: those costed); ``configured_remat`` / ``grad_accum`` what the trainer will run
    (other values are ranked but marked not runnable; ``configured_remat=None``: any);
    ``pipeline`` the configured pipeline settings and whether the trainer can run stages;
    ``balance`` how the executor cuts stages; ``grad_compression`` how the data-axis
    gradient reduction is encoded (its bytes).
    """
    if n_devices < 1:
        raise PlanError(f"the device count must be >= 1, got {n_devices}")
    rules = sharding.normalize_rules(rules or sharding.DEFAULT_RULES)
    start = time.perf_counter()
    kw = {"fixed": fixed, "remats": remats, "grad_accum": grad_accum,
          "configured_remat": configured_remat, "pipeline": pipeline, "balance": balance,
          "grad_compression": grad_compression}
    ctx, result = _search(cost, n_devices, profile, rules, dict(kw))
    best, notes = choose(result)
    if best is None:
        why = ", ".join(f"{k} ({v})" for k, v in result.dropped.items()) or "none enumerated"
        raise PlanError(f"no layout of {n_devices} devices is possible with mesh constraints "
                        f"{dict(fixed or {})}: {why}")
    needed = None
    if not best.fits:
        found = devices_needed(cost, n_devices, profile, rules, kw)
        if found is None:
            notes.append(f"nothing fits even on {n_devices * 2**MAX_DOUBLINGS} x {profile.kind}")
        else:
            needed, c = found
            notes.append(f"about {needed} x {profile.kind} would be needed: on {needed}, "
                         f"{mesh_str(c.mesh)} ({describe(c.layout)}) is predicted at "
                         f"{fmt_bytes(c.prediction.per_device_bytes)} per device")
    alternatives = [_alternative(c, best, ctx.memory_limit)
                    for c in itertools.islice((c for c in result.ranked if c is not best), top)]
    return Plan(mesh=best.mesh, remat=best.layout.remat, microbatches=best.layout.microbatches,
                stages=best.prediction.stages, predicted=best.prediction, fits=best.fits,
                runnable=best.runnable, rules=rules,
                param_specs=_param_specs(cost, best.mesh, rules),
                layers=[lay.to_dict() for lay in cost.layers], alternatives=alternatives,
                dropped=dict(result.dropped), device=profile, n_devices=n_devices,
                memory_limit=ctx.memory_limit, planning_time_s=time.perf_counter() - start,
                notes=notes + list(cost.warnings), schedule=best.prediction.schedule,
                virtual=best.prediction.virtual, blockers=list(best.blockers),
                devices_needed=needed, candidates=result.ranked,
                _search_args={"cost": cost, "kw": kw})


def plan_for_config(config: TrainerConfig, cost: ModelCost, n_devices: int, *,
                    rules: Sequence | None = None, device_kind: str | None = None,
                    remats: Sequence[str] | None = None, strict: bool = False,
                    measure_cpu: bool = False, pipeline: bool = True) -> Plan:
    """Plan ``cost`` as a run's config asks: its explicit mesh axes are fixed, its ``[device]``
    section describes the devices, its ``train.microbatches``, ``[pipeline]`` settings and the
    model's own remat policy (``cost.runs_as``; ``"auto"``: any) are what can run.

    ``remats`` are the policies to rank (default: only the runnable one, or every costed one
    when the remat is ``auto``); ``pipeline``: whether the trainer can split this model into
    stages. The Trainer keeps the defaults ``strict=False`` (an unknown device kind describes
    itself) and ``measure_cpu=False``: every process of a multi-host run must reach the same
    plan, so no measured number may enter it. ``jaxmp plan`` passes ``strict=True,
    measure_cpu=True``.
    """
    fixed = {a: v for a, v in config.mesh.explicit().items() if v != -1}
    profile = profile_from_config(config.device, device_kind, strict=strict,
                                  measure_cpu=measure_cpu)
    auto = cost.runs_as == "auto"
    if not remats:
        remats = tuple(cost.layers[0].saved) if auto and cost.layers else (cost.runs_as,)
    pc, pc_m = config.pipeline, config.train.microbatches
    options = PipelineOptions(schedule=pc.schedule, virtual=pc.virtual_stages,
                              microbatches=config.train.microbatches, runnable=pipeline)
    return plan(cost, n_devices, profile, rules=rules, fixed=fixed, remats=tuple(remats),
                grad_accum=1 if pc_m == "auto" else pc_m,
                configured_remat=None if auto else cost.runs_as, pipeline=options,
                balance=pc.balance, grad_compression=Compression.from_config(config.compression))
