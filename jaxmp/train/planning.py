"""Where a Trainer's layout comes from, and how it is read back from what was built.

A model reaches the planner as a :class:`~jaxmp.cost.ModelCost` (given by a recipe, or traced
from an example batch, at most once) and goes to :func:`jaxmp.plan.make_plan`, the same
function ``jaxmp train``, ``jaxmp plan`` and ``jaxmp bench`` call; without costs the same
function fills the layout from the config. The Trainer builds exactly the plan's
:class:`~jaxmp.plan.Layout`; :func:`split_of` and :func:`remat_of` read two of its fields back
from the built state and model (``Trainer.executed_layout``), so a test can compare.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxmp.config import TrainerConfig
from jaxmp.cost import ModelCost, model_costs
from jaxmp.devices import devices_kind
from jaxmp.errors import ConfigError
from jaxmp.pipeline.schedule import Schedule
from jaxmp.pipeline.stages import StageSplit
from jaxmp.plan import Layout, Plan, make_plan
from jaxmp.sharding.tree import ROWS_KEY


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


def plan_run(config: TrainerConfig, devices: Sequence, costs: CostSource, rules: Sequence,
             pipeline: bool, stack_blocks: int, compute_dtype: str | None,
             remat: str, param_dtype: str | None = None) -> Plan:
    """The Trainer's plan: :func:`jaxmp.plan.make_plan` with the model's costs when they can
    be had (no measured numbers: every process of a run reaches the same plan), for the
    Trainer's ``devices`` — their kind unless ``device.kind`` names one (deviceless GPUs
    are planned as those GPUs, not as this process's CPU)."""
    cost = costs.get()
    plan = make_plan(config, cost, len(devices), rules=rules, pipeline=pipeline,
                     stack_blocks=stack_blocks if pipeline else None,
                     compute_dtype=compute_dtype, remat=remat, param_dtype=param_dtype,
                     device_kind=devices_kind(config.device, devices))
    plan.cost_time_s = costs.seconds
    return plan


def check_plan(plan: Plan, n_devices: int, pipeline: bool, stack_blocks: int) -> None:
    """Refuse a plan this Trainer cannot build as it is."""
    if plan.n_devices != n_devices:
        raise ConfigError(f"the plan is for {plan.n_devices} devices but the Trainer has "
                          f"{n_devices}")
    split = plan.layout.split
    if plan.layout.stages > 1 and not pipeline:
        raise ConfigError(f"mesh.stage={plan.layout.stages}: this model cannot be split into "
                          f"stages (it needs a PipelineSpec: pre, a stacked layer module, post)")
    if split is not None and split.n_blocks != stack_blocks:
        raise ConfigError(f"the plan splits {split.n_blocks} blocks but the model's layer "
                          f"stack has {stack_blocks}")


def split_of(stack_params: Any, stages: int, virtual: int, n_blocks: int) -> StageSplit:
    """The stage split a padded layer stack was built with, read back from its parameters:
    their ``[stages, virtual·Lmax, ...]`` shape and each block's padded row (the Variables'
    row map, :data:`jaxmp.sharding.tree.ROWS_KEY`)."""
    leaf = next(v for v in jax.tree.leaves(stack_params, is_leaf=lambda x: isinstance(
        x, nnx.Variable)) if isinstance(v, nnx.Variable))
    rows = np.asarray(leaf.get_metadata()[ROWS_KEY])
    width = int(leaf.get_value().shape[1])  # virtual · Lmax
    lmax = width // virtual
    device, within = rows // width, rows % width
    chunk = (within // lmax) * stages + device
    per_chunk = np.bincount(chunk, minlength=stages * virtual)
    # Chunk 0 starts with pre, the last ends with post; between, each chunk's blocks in order.
    ends = 1 + np.cumsum(per_chunk)
    ends[-1] = n_blocks + 2
    starts = np.concatenate([[0], ends[:-1]])
    return StageSplit(stages, virtual, tuple((int(a), int(b)) for a, b in zip(starts, ends)),
                      n_blocks)


def remat_of(model: nnx.Module) -> str:
    """The remat policy a model was built with (``model.remat`` or its config's, as the GPT
    keeps it), else ``"none"``: the model as written."""
    for owner in (model, getattr(model, "cfg", None), getattr(model, "config", None)):
        policy = getattr(owner, "remat", None)
        if isinstance(policy, str):
            return policy
    return "none"


def attention_of(model: nnx.Module) -> str:
    """The attention kernel a model was built with, read from its modules: each that names
    one in an ``implementation`` attribute (the GPT's attention layers); ``""`` when none does
    (a model that calls its attention its own way), ``"mixed"`` when they differ."""
    kinds = {m.implementation for _, m in nnx.iter_modules(model)
             if isinstance(getattr(m, "implementation", None), str)}
    return kinds.pop() if len(kinds) == 1 else "mixed" if kinds else ""


@dataclass(frozen=True)
class Stages:
    """What a pipelined step's executor is built with: the schedule it runs (its tick tables)
    and the split of the layer stack into chunks."""

    schedule: Schedule
    split: StageSplit

    @classmethod
    def of(cls, layout: Layout) -> Stages | None:
        if layout.stages == 1:
            return None
        return cls(Schedule(layout.schedule, layout.stages, layout.microbatches,
                            layout.virtual_stages), layout.split)
