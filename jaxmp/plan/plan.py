"""The search's result, a :class:`Plan`, for a model's costs on a number of devices.

``plan(cost, n_devices, profile)`` enumerates every factorisation data × stage × fsdp × tensor
of the devices, with remat policies, microbatches and pipeline schedules, predicts memory and
step time for each (:mod:`jaxmp.plan.predict`), and returns the fastest runnable layout that
fits, its per-parameter partition specs, stage ranges and predictions, and the ranked
alternatives with the reason each lost. When nothing fits it says how many devices of the kind
would be needed. The front door is :func:`jaxmp.plan.make_plan` (:mod:`jaxmp.plan.make`), which
turns a run's config into this search's constraints; the Trainer, ``jaxmp train``, ``jaxmp
plan`` and ``jaxmp bench`` all go through it.

The planner knows no model and no trainer: a model reaches it only as a
:class:`~jaxmp.cost.ModelCost`. Layers (and stage ranges) index that cost table: ``pre`` (the
embedding), each block, other top-level modules, ``post`` (head and loss); ranges are half-open
``[start, end)``; with pipeline stages there is one range per chunk, chunk ``c`` on stage
``c % stages``.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from jaxmp import sharding
from jaxmp._util.fmt import fmt_bytes, fmt_time, mesh_str
from jaxmp.compression.reduce import Compression
from jaxmp.cost import ModelCost
from jaxmp.devices import DeviceProfile
from jaxmp.errors import PlanError
from jaxmp.pipeline.schedule import Schedule
from jaxmp.plan.context import Context
from jaxmp.plan.prediction import Prediction
from jaxmp.plan.layout import Layout
from jaxmp.plan.search import (Candidate, PipelineOptions, SearchResult, choose, describe,
                               reason_lost, search)

MAX_DOUBLINGS = 10  # how far "devices needed" looks: up to 1024x the devices given


@dataclass
class Plan:
    """What one step runs (:attr:`layout`, decided once) with its predictions and the
    alternatives it beat. Without model costs the layout is the config's with documented
    defaults and every prediction is None (:func:`jaxmp.plan.make_plan`)."""

    layout: Layout
    predicted: Prediction | None
    fits: bool | None
    runnable: bool
    rules: tuple
    n_devices: int
    param_specs: dict[str, list] = field(default_factory=dict)
    layers: list[dict] = field(default_factory=list)
    alternatives: list[dict] = field(default_factory=list)
    dropped: dict[str, int] = field(default_factory=dict)
    device: DeviceProfile | None = None
    memory_limit: float | None = None
    planning_time_s: float = 0.0
    cost_time_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    verify: dict | None = None
    blockers: list[str] = field(default_factory=list)
    devices_needed: int | None = None  # when nothing fits: devices of this kind that would do
    candidates: list[Candidate] = field(default_factory=list, repr=False)  # ranked, all

    # The layout's fields, as plans always showed them.
    @property
    def mesh(self) -> dict[str, int]:
        return self.layout.sizes

    @property
    def remat(self) -> str:
        return self.layout.remat

    @property
    def microbatches(self) -> int:
        return self.layout.microbatches

    @property
    def schedule(self) -> str:
        return self.layout.schedule

    @property
    def virtual(self) -> int:
        return self.layout.virtual_stages

    @property
    def stages(self) -> list[tuple[int, int]]:
        """Each chunk's half-open range of the cost model's layers ([] without costs)."""
        return list(self.predicted.stages) if self.predicted is not None else []

    def describe(self) -> str:
        """The settings besides the mesh (``"remat full, 1f1b, 8 mb"``)."""
        return describe(self.layout)

    def to_json(self) -> dict[str, Any]:
        """The plan as plain JSON values (what ``plan.json`` and ``jaxmp plan --json`` hold):
        the layout's every field under ``layout`` and the common ones at the top."""
        lay = self.layout
        out = {"layout": lay.to_json(), "mesh": dict(self.mesh),
               "stages": [list(s) for s in self.stages], "remat": lay.remat,
               "microbatches": lay.microbatches, "schedule": lay.schedule,
               "virtual_stages": lay.virtual_stages, "xla_flags": lay.xla_flags,
               "status": "runnable" if self.runnable else
               "not runnable: " + "; ".join(self.blockers),
               "fits": self.fits,
               "predicted": self.predicted.to_dict() if self.predicted is not None else None,
               "memory_limit_bytes": self.memory_limit, "n_devices": self.n_devices,
               "devices_needed": self.devices_needed,
               "device": self.device.to_dict() if self.device is not None else None,
               "rules": [[name, list(axes) if isinstance(axes, tuple) else axes]
                         for name, axes in self.rules],
               "param_specs": self.param_specs, "layers": self.layers,
               "alternatives": self.alternatives, "dropped": self.dropped,
               "notes": list(self.notes), "planning_time_s": self.planning_time_s,
               "cost_time_s": self.cost_time_s}
        if lay.stages > 1:
            out["pipeline"] = pipeline_json(lay)
        if self.verify is not None:
            out["verify"] = self.verify
        return out


def pipeline_json(layout: Layout) -> dict[str, Any]:
    """The schedule's closed forms for a layout with stages (``plan.json``'s ``pipeline``)."""
    s = Schedule(layout.schedule, layout.stages, layout.microbatches, layout.virtual_stages)
    return {"ticks": s.n_ticks, "bubble_fraction": s.bubble_fraction,
            "in_flight": [s.in_flight(d) for d in range(s.stages)]}


def _alternative(c: Candidate, best: Candidate, limit: float) -> dict[str, Any]:
    p = c.prediction
    return {"mesh": c.mesh, "stages": [list(s) for s in p.stages], "remat": c.layout.remat,
            "microbatches": c.layout.microbatches, "schedule": c.layout.schedule,
            "virtual_stages": c.layout.virtual_stages,
            "optimizer_sharding": c.layout.optimizer_sharding, "settings": describe(c.layout),
            "fits": c.fits, "runnable": c.runnable,
            "predicted": {"per_device_bytes": p.per_device_bytes,
                          "step_time_s": p.step_time_s, "flops_per_step": p.flops_per_step,
                          "comm_bytes_per_step": p.comm_bytes_per_step,
                          "bubble_s": p.bubble_s},
            "reason": reason_lost(c, best, limit)}


def _resolved(cost: ModelCost, mesh: Mapping[str, int],
              rules: Sequence) -> dict[str, sharding.Resolution | None]:
    """Each parameter path's rule resolution on ``mesh``, once per path (a stack's layers
    share their leaves); ``None`` for a leaf without logical names."""
    sizes = {**mesh, "stage": 1}  # stages split layers by range, not by a param dim
    out: dict[str, sharding.Resolution | None] = {}
    for lay in cost.layers:
        for leaf in lay.params:
            if leaf.path not in out:
                out[leaf.path] = None if leaf.names is None else sharding.resolve(
                    leaf.names, leaf.shape, sizes, rules, leaf.path)
    return out


def _param_specs(resolved: Mapping[str, sharding.Resolution | None]) -> dict[str, list]:
    return {path: [list(e) if isinstance(e, tuple) else e for e in (r.spec if r else ())]
            for path, r in resolved.items()}


def fallback_note(resolved: Mapping[str, sharding.Resolution | None]) -> str | None:
    """One line naming the weights a mesh axis skips because it does not divide their dim
    (e.g. heads 3 on tensor 2: attention replicated over tensor); the prediction counts
    them as the rules place them, replicated."""
    found = {(f.logical, f.dim_size, f.mesh_axis, f.axis_size): path
             for path, r in resolved.items() if r is not None for f in r.fallbacks}
    if not found:
        return None
    return "replicated where the axis does not divide: " + "; ".join(
        f"{logical} {n} on {axis} {size} ({path}, ...)"
        for (logical, n, axis, size), path in found.items()) \
        + " (the prediction counts them replicated)"


@dataclass(frozen=True)
class SearchSettings:
    """Everything a search needs besides the model, the devices and their profile."""

    rules: tuple = ()
    fixed: Mapping[str, int] | None = None
    remats: Sequence[str] | None = None
    microbatches: int | str = "auto"
    configured_remat: str | None = None
    pipeline: PipelineOptions | None = None
    balance: str = "flops"
    compression: Compression | None = None
    weights: str = "auto"
    compute_dtype: str | None = None
    optimizer_sharding: str = "auto"
    sequence_parallel: bool | str = "auto"
    master_weights: str = "auto"

    def context(self, cost: ModelCost, n: int, profile: DeviceProfile) -> Context:
        return Context(cost, profile, n, self.rules, balance=self.balance,
                       compression=self.compression, weights=self.weights,
                       compute_dtype=self.compute_dtype,
                       sequence_parallel=self.sequence_parallel,
                       master_weights=self.master_weights)

    def search(self, ctx: Context, fixed: Mapping[str, int] | None = None) -> SearchResult:
        try:
            return search(ctx, fixed, self.remats, self.microbatches, self.configured_remat,
                          self.pipeline, self.optimizer_sharding)
        except ValueError as e:
            raise PlanError(str(e)) from None


def devices_needed(cost: ModelCost, n_devices: int, profile: DeviceProfile,
                   settings: SearchSettings) -> tuple[int, Candidate] | None:
    """The fewest devices of ``profile`` (``n_devices`` doubled) on which a runnable plan
    fits, with that plan; None past ``MAX_DOUBLINGS``. The user's fixed axes are dropped."""
    for k in range(1, MAX_DOUBLINGS + 1):
        n = n_devices * 2**k
        result = settings.search(settings.context(cost, n, profile))
        fitting = [c for c in result.ranked if c.runnable and c.fits]
        if fitting:
            return n, fitting[0]
    return None


def setting_that_fits(result: SearchResult, fixed: Mapping[str, int] | None = None) -> str | None:
    """When nothing runnable fits: the plan that fits with the fewest settings changed (then
    the fastest), as ``"set model.remat='full': 16x4x16 (remat full, 8 mb) fits at 52 GiB,
    13.4 s per step"`` (None: no setting on these devices makes one fit). ``fixed``: the mesh
    axes the user set, when ``result`` was searched without them — each one a candidate
    changes is a setting too."""
    def changes(c: Candidate) -> list[str]:
        axes = [f"mesh.{a}={c.mesh.get(a, 1)}" for a, n in (fixed or {}).items()
                if c.mesh.get(a, 1) != n]
        return axes + [b.removeprefix("needs ") for b in c.blockers]

    fitting = [c for c in result.ranked
               if c.fits and all(b.startswith("needs ") and "=" in b for b in c.blockers)]
    if not fitting:
        return None
    c = min(fitting, key=lambda c: len(changes(c)))  # fewest settings changed, then fastest
    p = c.prediction
    return (f"nothing runnable fits under the fixed settings; set {' and '.join(changes(c))}: "
            f"{mesh_str(c.mesh)} ({describe(c.layout)}) fits at "
            f"{fmt_bytes(p.per_device_bytes)} per device, {fmt_time(p.step_time_s)} per step")


def plan(cost: ModelCost, n_devices: int, profile: DeviceProfile,
         rules: Sequence | None = None, fixed: Mapping[str, int] | None = None,
         remats: Sequence[str] | None = None, microbatches: int | str = "auto",
         configured_remat: str | None = None, top: int = 8,
         pipeline: PipelineOptions | None = None, balance: str = "flops",
         compression: Compression | None = None, weights: str = "auto",
         compute_dtype: str | None = None, find_devices_needed: bool = True,
         optimizer_sharding: str = "auto", sequence_parallel: bool | str = "auto",
         master_weights: str = "auto") -> Plan:
    """Plan ``cost`` (from :func:`jaxmp.cost.model_costs`) on ``n_devices`` of ``profile``:
    the search behind :func:`jaxmp.plan.make_plan`, which turns a run's config into these
    arguments.

    ``fixed`` holds axis sizes the user set (constraints); ``remats`` the policies to consider
    (default: those costed); ``configured_remat`` / ``microbatches`` what the trainer will run
    (``"auto"`` / None: the search chooses; other values are ranked but marked not runnable);
    ``pipeline`` the configured pipeline settings and whether the trainer can run stages;
    ``balance`` how the executor cuts stages; ``compression`` how the data-axis gradient
    reduction is encoded; ``weights`` / ``compute_dtype`` what fsdp gathers move;
    ``optimizer_sharding`` is ``train.optimizer_sharding``, ``sequence_parallel``
    ``train.sequence_parallel``, ``master_weights`` ``train.master_weights``.

    When no runnable plan fits but one the user's fixed settings rule out does, the plan says
    which settings would make it fit (:func:`setting_that_fits`) rather than a device count.
    """
    if n_devices < 1:
        raise PlanError(f"the device count must be >= 1, got {n_devices}")
    rules = sharding.normalize_rules(rules or sharding.DEFAULT_RULES)
    start = time.perf_counter()
    settings = SearchSettings(rules, fixed, tuple(remats) if remats else None, microbatches,
                              configured_remat, pipeline, balance, compression, weights,
                              compute_dtype, optimizer_sharding, sequence_parallel,
                              master_weights)
    ctx = settings.context(cost, n_devices, profile)
    result = settings.search(ctx, fixed)
    best, notes = choose(result)
    if best is None:
        why = ", ".join(f"{k} ({v})" for k, v in result.dropped.items()) or \
            "every candidate needs other settings"
        raise PlanError(f"no layout of {n_devices} devices is possible with mesh constraints "
                        f"{dict(fixed or {})}: {why}")
    needed = None
    fix = setting_that_fits(result) if not best.fits else None
    if fix is None and not best.fits and fixed:  # the user's mesh axes are settings too
        fix = setting_that_fits(settings.search(ctx), fixed)
    if fix is not None:
        notes.append(fix)
    elif not best.fits and find_devices_needed:
        found = devices_needed(cost, n_devices, profile, settings)
        if found is None:
            notes.append(f"nothing fits even on {n_devices * 2**MAX_DOUBLINGS} x {profile.kind}")
        else:
            needed, c = found
            notes.append(f"about {needed} x {profile.kind} would be needed: on {needed}, "
                         f"{mesh_str(c.mesh)} ({describe(c.layout)}) is predicted at "
                         f"{fmt_bytes(c.prediction.per_device_bytes)} per device")
    alternatives = [_alternative(c, best, ctx.memory_limit)
                    for c in itertools.islice((c for c in result.ranked if c is not best), top)]
    resolved = _resolved(cost, best.mesh, rules)
    return Plan(layout=best.layout, predicted=best.prediction, fits=best.fits,
                runnable=best.runnable, rules=rules, n_devices=n_devices,
                param_specs=_param_specs(resolved),
                layers=[lay.to_dict() for lay in cost.layers], alternatives=alternatives,
                dropped=dict(result.dropped), device=profile, memory_limit=ctx.memory_limit,
                planning_time_s=time.perf_counter() - start,
                notes=notes + [n for n in (fallback_note(resolved),) if n]
                + list(cost.warnings), blockers=list(best.blockers),
                devices_needed=needed, candidates=result.ranked)
