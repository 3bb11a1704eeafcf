"""Where a run's layout comes from: the mesh (the config's axes, or — all ``auto`` — the
planner's plan) and, with ``mesh.stage > 1``, the pipeline's stages and schedule.

The one place a Trainer plans. A model reaches the planner as a :class:`~jaxmp.cost.ModelCost`
(given by a recipe, or traced from an example batch, at most once) and goes to
:func:`jaxmp.plan.plan_for_config`, the same function ``jaxmp plan`` uses; the pipeline's stage
boundaries come from the same per-layer costs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax

from jaxmp.config import TrainerConfig
from jaxmp.cost import ModelCost, model_costs
from jaxmp.errors import ConfigError
from jaxmp.mesh import make_mesh
from jaxmp.pipeline.schedule import Schedule
from jaxmp.pipeline.stages import StageSplit, split_layers
from jaxmp.plan import Plan, plan_for_config


class CostSource:
    """A model's per-layer costs, computed at most once and only when something needs them."""

    def __init__(self, model_fn: Callable, loss_fn: Callable,
                 cost: ModelCost | Callable[[], ModelCost] | None = None,
                 example_batch: Any = None, path_rules: Sequence | None = None):
        self.model_fn, self.loss_fn, self.example_batch = model_fn, loss_fn, example_batch
        self.path_rules, self._given, self._cost = path_rules, cost, None
        self.seconds = 0.0

    def get(self) -> ModelCost | None:
        if self._cost is None:
            start = time.perf_counter()
            cost = self._given() if callable(self._given) else self._given
            if cost is None and self.example_batch is not None:
                cost = model_costs(self.model_fn, self.example_batch, self.loss_fn,
                                   policies=("none",), path_rules=self.path_rules)
            self._cost, self.seconds = cost, time.perf_counter() - start
        return self._cost


def plan_model(config: TrainerConfig, n_devices: int, costs: CostSource,
               rules: Sequence | None = None, pipeline: bool = True) -> Plan | None:
    """The plan for an all-``auto`` mesh or an ``auto`` remat policy, or None (nothing to
    choose, or nothing to cost from).

    The model is costed with the Trainer's ``path_rules`` and planned with its ``rules``, so the
    plan's partition specs are the ones the step will use; ``pipeline``: whether the model can
    be split into stages (the Trainer has a PipelineSpec)."""
    cost = costs.get()
    if cost is None or not (config.mesh.is_auto or cost.runs_as == "auto"):
        return None
    plan = plan_for_config(config, cost, n_devices, rules=rules, pipeline=pipeline)
    plan.cost_time_s = costs.seconds
    return plan


def accumulation(config: TrainerConfig, mesh: jax.sharding.Mesh) -> int:
    """Microbatches the step accumulates without pipeline stages (1 for "auto"); with stages
    the pipeline executor takes ``train.microbatches`` instead and this is 1."""
    m = config.train.microbatches
    return 1 if m == "auto" or int(mesh.shape["stage"]) > 1 else int(m)


def mesh_for(config: TrainerConfig, devices: Sequence[jax.Device],
             plan: Plan | None = None) -> jax.sharding.Mesh:
    """The mesh the config asks for; with ``mesh`` all ``auto``, the plan's (else data-parallel)."""
    sizes = plan.mesh if plan is not None and config.mesh.is_auto else config.mesh.sizes()
    try:
        return make_mesh(sizes, devices)
    except ValueError as e:  # a config that cannot fit the devices is bad input, not a crash
        raise ConfigError(f"mesh: {e}") from None


@dataclass(frozen=True)
class Stages:
    """A pipelined run's schedule and stage split (and the JSON ``plan.json`` records)."""

    schedule: Schedule
    split: StageSplit

    def to_json(self) -> dict[str, Any]:
        s = self.schedule
        return {"schedule": s.kind, "stages": s.stages, "virtual_stages": s.virtual,
                "microbatches": s.microbatches, "chunks": [list(b) for b in self.split.bounds],
                "blocks_per_chunk": self.split.per_chunk, "ticks": s.n_ticks,
                "bubble_fraction": s.bubble_fraction,
                "in_flight": [s.in_flight(d) for d in range(s.stages)]}


def stage_costs(cost: ModelCost, stack: str) -> list[float]:
    """Per-layer training FLOPs folded to the pipeline's table: everything before the stack's
    first block is ``pre``, every block, everything after the last block is ``post``."""
    flops = [lay.flops(cost.runs_as) for lay in cost.layers]
    blocks = [i for i, lay in enumerate(cost.layers) if lay.group == stack and lay.kind == "block"]
    if not blocks:
        raise ConfigError(f"mesh.stage > 1: the model has no layer stack {stack!r} to pipeline")
    lo, hi = blocks[0], blocks[-1] + 1
    return [sum(flops[:lo])] + flops[lo:hi] + [sum(flops[hi:])]


def plan_stages(config: TrainerConfig, mesh: jax.sharding.Mesh, stack: str | None,
                n_blocks: int, costs: CostSource, plan: Plan | None) -> Stages | None:
    """The schedule and split for ``mesh.stage > 1`` (None without stages); bad input raises."""
    p, pc = int(mesh.shape["stage"]), config.pipeline
    if p == 1:
        return None
    if stack is None:
        raise ConfigError(f"mesh.stage={p}: this model cannot be split into stages (it needs a "
                          f"PipelineSpec: pre, a stacked layer module, post)")
    planned = plan is not None and plan.mesh.get("stage", 1) == p and bool(plan.schedule)
    kind = pc.schedule if pc.schedule != "auto" else plan.schedule if planned else "1f1b"
    v = pc.virtual_stages if pc.virtual_stages != "auto" else \
        plan.virtual if planned and kind == plan.schedule else 2 if kind == "interleaved" else 1
    m = config.train.microbatches if config.train.microbatches != "auto" else \
        plan.microbatches if planned else 2 * p
    schedule = Schedule(kind, p, m, v)
    shards = int(mesh.shape["data"] * mesh.shape["fsdp"])
    rows = config.train.batch_size
    if rows % (m * shards):
        raise ConfigError(f"train.batch_size={rows} does not split into train.microbatches="
                          f"{m} x {shards} batch shards (data x fsdp)")
    if pc.balance == "flops":
        cost = costs.get()
        if cost is None:
            raise ConfigError("pipeline.balance='flops' needs the model's costs (give the Trainer "
                              "an example_batch) or use pipeline.balance='layers'")
        table = stage_costs(cost, stack)
    else:
        table = [1.0] * (n_blocks + 2)
    return Stages(schedule, split_layers(table, p, v, pc.balance))
