"""Where a run's mesh comes from: the config's axes, or — all ``auto`` — the planner's plan.

The one place a Trainer plans: :func:`plan_model` turns a model into a
:class:`~jaxmp.cost.ModelCost` (given, or traced from an example batch) and hands it to
:func:`jaxmp.plan.plan_for_config`, the same function ``jaxmp plan`` uses.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jaxmp.config import TrainerConfig
from jaxmp.cost import ModelCost, model_costs
from jaxmp.errors import ConfigError
from jaxmp.mesh import make_mesh
from jaxmp.plan import Plan, plan_for_config


def plan_model(config: TrainerConfig, n_devices: int, model_fn: Callable, loss_fn: Callable,
               *, cost: ModelCost | Callable[[], ModelCost] | None = None,
               example_batch: Any = None, rules: Sequence | None = None,
               path_rules: Sequence | None = None) -> Plan | None:
    """The plan for an all-``auto`` mesh, or None (explicit mesh, or nothing to cost from).

    The model is costed with the Trainer's ``path_rules`` and planned with its ``rules``, so the
    plan's partition specs are the ones the step will use."""
    if not config.mesh.is_auto:
        return None
    start = time.perf_counter()
    if callable(cost):
        cost = cost()
    if cost is None and example_batch is not None:
        cost = model_costs(model_fn, example_batch, loss_fn, policies=("none",),
                           path_rules=path_rules)
    if cost is None:
        return None
    cost_time = time.perf_counter() - start
    plan = plan_for_config(config, cost, n_devices, rules=rules)
    plan.cost_time_s = cost_time
    return plan


def mesh_for(config: TrainerConfig, devices: Sequence[jax.Device],
             plan: Plan | None = None) -> jax.sharding.Mesh:
    """The mesh the config asks for; with ``mesh`` all ``auto``, the plan's (else data-parallel)."""
    sizes = plan.mesh if plan is not None and config.mesh.is_auto else config.mesh.sizes()
    try:
        return make_mesh(sizes, devices)
    except ValueError as e:  # a config that cannot fit the devices is bad input, not a crash
        raise ConfigError(f"mesh: {e}") from None
