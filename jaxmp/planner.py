"""The planner: choose the mesh (and stages, remat, microbatches) from measured layer costs.

``plan(cost, n_devices, profile)`` enumerates every factorisation data × stage × fsdp × tensor
of the devices, predicts memory and step time for each (:mod:`jaxmp.plan.predict`), drops the
ones that do not fit, and returns a :class:`Plan`: the fastest runnable layout, its per-parameter
partition specs, stage ranges and predictions, and the ranked alternatives with the reason each
lost. ``plan_for_config`` does this for the configured GPT (``jaxmp train`` calls it when the
mesh is left on ``auto``), ``plan_for_model`` for any NNX model (the Trainer, given an
``example_batch``); ``choose_mesh`` returns just the chosen axis sizes. Every prediction is checkable: ``Plan.verify`` compiles
the real train step and compares (:mod:`jaxmp.plan.verify`).

Layers (and stage ranges) index the per-layer cost table: ``pre`` (the embedding), each block,
other top-level modules, ``post`` (head and loss); ranges are half-open ``[start, end)``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from jaxmp.devices import DeviceProfile, profile_for
from jaxmp.plan.balance import InfeasibleError, balance_stages  # noqa: F401 - public API
from jaxmp.plan.errors import PlanError
from jaxmp.plan.search import PIPELINE_NOTE, Candidate, choose, reason_lost, search

if TYPE_CHECKING:
    from jaxmp.config import Config
    from jaxmp.cost import ModelCost

__all__ = ["Plan", "PlanError", "plan", "plan_for_config", "plan_for_model", "choose_mesh",
           "config_costs", "balance_stages", "add_plan_parser"]


@dataclass
class Plan:
    """A chosen layout with its predictions and the alternatives it beat."""

    mesh: dict[str, int]
    remat: str
    microbatches: int
    stages: list[tuple[int, int]]
    predicted: Any  # jaxmp.plan.predict.Prediction
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
    from jaxmp import rules as rules_lib

    sizes = {**mesh, "stage": 1}  # stages split layers by range, not by a param dim
    out: dict[str, list] = {}
    for lay in cost.layers:
        for leaf in lay.params:
            if leaf.path not in out:
                spec = rules_lib.resolve(leaf.names, leaf.shape, sizes,
                                         rules_lib.normalize_rules(rules)).spec \
                    if leaf.names is not None else ()
                out[leaf.path] = [list(e) if isinstance(e, tuple) else e for e in spec]
    return out


def plan(cost: ModelCost, n_devices: int, profile: DeviceProfile,
         rules: Sequence | None = None, fixed: Mapping[str, int] | None = None,
         remats: Sequence[str] | None = None, grad_accum: int = 1,
         configured_remat: str | None = None, top: int = 8) -> Plan:
    """Plan ``cost`` (from :func:`jaxmp.cost.model_costs`) on ``n_devices`` of ``profile``.

    ``fixed`` holds axis sizes the user set (constraints); ``remats`` the policies to consider
    (default: those costed); ``configured_remat`` / ``grad_accum`` what the trainer will run
    (other values are ranked but marked not runnable).
    """
    from jaxmp import rules as rules_lib
    from jaxmp.plan.predict import Context

    if n_devices < 1:
        raise PlanError(f"the device count must be >= 1, got {n_devices}")
    rules = tuple(rules_lib.normalize_rules(rules or rules_lib.DEFAULT_RULES))
    start = time.perf_counter()
    ctx = Context(cost, profile, n_devices, rules)
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
    specs = _param_specs(cost, best.mesh, rules)
    return Plan(mesh=best.mesh, remat=best.layout.remat, microbatches=best.layout.microbatches,
                stages=best.prediction.stages, predicted=best.prediction, fits=best.fits,
                runnable=best.runnable, rules=rules, param_specs=specs,
                layers=[lay.to_dict() for lay in cost.layers], alternatives=alternatives,
                dropped=dict(result.dropped), device=profile, n_devices=n_devices,
                memory_limit=ctx.memory_limit, planning_time_s=time.perf_counter() - start,
                notes=notes + list(cost.warnings))


# ---------------------------------------------------------------------------------------------
# From a config (the GPT recipe).

_COST_CACHE: dict[tuple, Any] = {}


def config_costs(config: Config, remats: Sequence[str] | None = None) -> ModelCost:
    """Per-layer costs of the configured GPT on the configured global batch (cached)."""
    import jax
    import jax.numpy as jnp

    from jaxmp.cost import REMAT_POLICIES, model_costs
    from jaxmp.models import GPT, lm_loss
    from jaxmp.recipes import gpt_config

    gcfg = gpt_config(config)
    remats = tuple(remats or REMAT_POLICIES)
    if "none" not in remats:
        remats = ("none",) + remats  # the working set of a rematted layer needs its full size
    shape = (config.train.batch_size, config.data.seq_len)
    key = (gcfg, shape)
    cached = _COST_CACHE.get(key)
    if cached is None or not set(remats) <= set(cached.layers[0].saved):
        # Trace with a scanned stack whatever the config says (one block: fast); the costs
        # are the same, only the fsdp re-gather of scanned weights depends on it.
        traced = dataclasses.replace(gcfg, scan_layers=True)
        batch = {"inputs": jax.ShapeDtypeStruct(shape, jnp.int32),
                 "targets": jax.ShapeDtypeStruct(shape, jnp.int32)}
        cost = model_costs(lambda rngs: GPT(traced, rngs=rngs), batch, lm_loss,
                           policies=remats)
        for lay in cost.layers:
            lay.in_loop = lay.kind == "block" and gcfg.scan_layers
        if len(_COST_CACHE) >= 4:
            _COST_CACHE.pop(next(iter(_COST_CACHE)))
        _COST_CACHE[key] = cost
    return _COST_CACHE[key]


def _device_overrides(config: Config) -> dict[str, Any]:
    section = getattr(config, "device", None)
    if section is None:
        return {}
    values = dataclasses.asdict(section) if dataclasses.is_dataclass(section) else dict(section)
    values.pop("kind", None)
    return values


def config_profile(config: Config, device_kind: str | None = None, strict: bool = True,
                   measure_cpu: bool = True) -> DeviceProfile:
    """The device profile for a config: ``device_kind``, else ``device.kind``, else detected.

    An unknown kind is an error when ``strict``; otherwise the first device describes itself:
    its memory limit from ``memory_stats()``, its peak measured (or nominal without
    ``measure_cpu``), the links of an H100 host.
    """
    from jaxmp.devices import match_kind, measured_matmul_flops

    kind = device_kind or getattr(getattr(config, "device", None), "kind", None)
    overrides = _device_overrides(config)
    if kind in (None, "", "auto"):
        import jax

        dev = jax.devices()[0]
        kind = "CPU" if dev.platform == "cpu" else dev.device_kind
        if match_kind(kind) is None and not strict:
            limit = (dev.memory_stats() or {}).get("bytes_limit", 16 * 2**30)
            overrides = {"peak_flops": measured_matmul_flops() if measure_cpu else 1e14,
                         "memory_bytes": float(limit), "usable_fraction": 1.0, **{
                             k: v for k, v in overrides.items() if v}}
    try:
        return profile_for(kind, overrides=overrides, strict=strict, measure_cpu=measure_cpu)
    except ValueError as e:
        raise PlanError(str(e)) from None


def plan_for_config(config: Config, n_devices: int, device_kind: str | None = None,
                    remats: Sequence[str] | None = None, measure_cpu: bool = True,
                    strict: bool = True) -> Plan:
    """Plan the configured GPT on ``n_devices``; the config's explicit mesh axes are fixed.

    ``remats`` limits the remat policies considered (default: all three; the configured one
    alone is faster to cost). The trainer passes ``measure_cpu=False`` (every process of a
    run must reach the same plan, so no measured number may enter it) and ``strict=False``
    (an unknown device kind falls back to a measured profile instead of failing).
    """
    fixed = {a: v for a, v in config.mesh.explicit().items() if v != -1}
    profile = config_profile(config, device_kind, strict=strict, measure_cpu=measure_cpu)
    start = time.perf_counter()
    cost = config_costs(config, remats)
    cost_time = time.perf_counter() - start
    result = plan(cost, n_devices, profile, fixed=fixed, remats=remats,
                  grad_accum=config.train.grad_accum, configured_remat=config.model.remat)
    result.cost_time_s = cost_time
    return result


def plan_for_model(model: Any, batch: Any, n_devices: int, loss_fn: Any = None,
                   profile: DeviceProfile | None = None, rules: Sequence | None = None,
                   fixed: Mapping[str, int] | None = None, grad_accum: int = 1,
                   tx: Any = None) -> Plan:
    """Plan any Flax NNX model (``model_fn(rngs)`` or a module) on ``batch`` (global shapes).

    Only the model as written is runnable (remat is the model's own business), so the
    policies are not varied; ``profile`` defaults to this process's first device.
    """
    from jaxmp.cost import model_costs

    if profile is None:
        import jax

        dev = jax.devices()[0]
        profile = profile_for("CPU" if dev.platform == "cpu" else dev.device_kind)
    start = time.perf_counter()
    cost = model_costs(model, batch, loss_fn, tx=tx, policies=("none",))
    cost_time = time.perf_counter() - start
    result = plan(cost, n_devices, profile, rules=rules, fixed=fixed, remats=("none",),
                  grad_accum=grad_accum, configured_remat="none")
    result.cost_time_s = cost_time
    return result


def choose_mesh(config: Config, n_devices: int) -> dict[str, int]:
    """Axis sizes for ``n_devices`` when the config leaves the mesh on ``auto``.

    The fastest plan the trainer can run as configured (no pipeline stages; the configured
    remat and accumulation) that is predicted to fit on this process's device kind. Every
    process of a multi-host run must choose the same mesh, so nothing measured (a CPU's
    matmul rate varies run to run) enters the choice.
    """
    try:
        profile = config_profile(config, strict=False, measure_cpu=False)
    except PlanError:
        profile = profile_for("CPU", measure_cpu=False)
    cost = config_costs(config, (config.model.remat,))
    fixed = {a: v for a, v in config.mesh.explicit().items() if v != -1}
    chosen = plan(cost, n_devices, profile, fixed=fixed, remats=(config.model.remat,),
                  grad_accum=config.train.grad_accum, configured_remat=config.model.remat)
    return dict(chosen.mesh)


def add_plan_parser(subparsers: Any) -> Any:
    """Register ``jaxmp plan`` on an argparse subparsers object (see :mod:`jaxmp.plan.cli`)."""
    from jaxmp.plan.cli import add_plan_parser as add

    return add(subparsers)
