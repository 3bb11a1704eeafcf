"""Check a plan against the compiled program: memory from ``memory_analysis()``, collectives
parsed from the optimized HLO (:func:`jaxmp.hlo.collective_stats`).

The step compiled here is the trainer's own (``plan_state`` + ``make_train_step``, the config's
optimizer, model, batch and accumulation), so what is compared is what ``jaxmp train`` would
run. On a machine without accelerators the devices are simulated CPU devices: the process must
have been started with ``--xla_force_host_platform_device_count=N`` (the CLI does that).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxmp.config import Config
from jaxmp.plan.errors import VerifyError
from jaxmp.plan.predict import Prediction

__all__ = ["VerifyError", "compile_step", "verify_prediction"]


def _rel(predicted: float, compiled: float) -> dict[str, float]:
    err = abs(predicted - compiled) / compiled if compiled else (0.0 if not predicted else 1.0)
    return {"predicted": float(predicted), "compiled": float(compiled), "rel_err": float(err)}


def compile_step(config: Config, mesh_sizes: dict[str, int], devices: list | None = None):
    """The trainer's jitted train step for ``config`` on ``mesh_sizes``, lowered and compiled."""
    from jaxmp.mesh import make_mesh
    from jaxmp.models import lm_loss
    from jaxmp.recipes import gpt_model_fn
    from jaxmp.rules import DEFAULT_RULES
    from jaxmp.train.loop import optimizer_spec
    from jaxmp.train.state import make_optimizer, make_schedule, plan_state
    from jaxmp.train.step import make_train_step

    devices = list(devices if devices is not None else jax.devices())
    n = 1
    for v in mesh_sizes.values():
        n *= v
    if len(devices) < n:
        raise VerifyError(f"--verify needs {n} devices but this process has {len(devices)}; "
                          f"start it with XLA_FLAGS=--xla_force_host_platform_device_count={n}")
    if mesh_sizes.get("stage", 1) > 1:
        raise VerifyError("pipeline stages cannot be compiled yet (pipeline execution arrives "
                          "with issue P)")
    mesh = make_mesh(mesh_sizes, devices[:n])
    spec = optimizer_spec(config)
    tx, sched = make_optimizer(spec, config.train.steps), make_schedule(spec, config.train.steps)
    layout = plan_state(gpt_model_fn(config), tx, mesh, DEFAULT_RULES)
    shape = (config.train.batch_size, config.data.seq_len)
    batch = {"inputs": jax.ShapeDtypeStruct(shape, jnp.int32),
             "targets": jax.ShapeDtypeStruct(shape, jnp.int32)}
    step = make_train_step(layout, lm_loss, tx, sched, batch, config.train.grad_accum,
                           DEFAULT_RULES)
    return step.lower(layout.abstract, batch).compile()


def verify_prediction(config: Config, mesh_sizes: dict[str, int], predicted: Prediction,
                      devices: list | None = None) -> dict[str, Any]:
    """Predicted vs compiled per-device argument bytes, peak bytes and collective bytes."""
    from jaxmp.hlo import collective_stats

    compiled = compile_step(config, mesh_sizes, devices)
    mem = compiled.memory_analysis()
    stats = collective_stats(compiled)
    args = float(mem.argument_size_in_bytes)
    peak = args + float(mem.temp_size_in_bytes)
    return {"argument_bytes": _rel(predicted.argument_bytes, args),
            "peak_bytes": _rel(predicted.per_device_bytes, peak),
            "comm_bytes_per_step": _rel(predicted.comm_bytes_per_step, stats.total_bytes),
            "compiled_comm_by_kind": {k: v for k, v in stats.bytes_by_kind.items() if v},
            "hlo_warnings": list(stats.warnings)}
