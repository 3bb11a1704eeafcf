"""``jaxmp bench``: parallelism strategies side by side, measured, beside the planner's predictions.

Every strategy trains the same model on the same global batch through the same step builder as
``jaxmp train`` (``Trainer.compile``). For each: per-device memory from the compiled program
(argument, temp, peak), the bytes each device sends per step by collective kind (from the
optimized HLO), the median step time over K timed steps after warm-up on a real batch of the
right shape, tokens/s, model FLOP/s and MFU (against the devices' peak; on CPU against a large
matmul measured in this process), and the planner's prediction for the same layout with the
relative error of each figure. Each strategy's layout is planned by the one planning function
(:func:`jaxmp.plan.make_plan`) with the strategy's mesh as config constraints and the config's
pipeline options, balance and compression; the Trainer gets that plan and builds it as is, so
the prediction beside each row is the plan the step runs. A strategy that cannot run gets a row
that says why: the planner's reason (divisibility, an axis that shards nothing, settings that
need something else), a mesh that needs other devices, a compiled peak above device memory, or
the error it failed with.

Bytes sent per step are what the busiest device executed in one profiled step on the CPU
backend (:mod:`jaxmp.hlo.executed`: a pipeline's devices run different branches of its tick's
``lax.cond``s, and none in a bubble tick); elsewhere the static count with each conditional
charged its largest branch (:mod:`jaxmp.hlo.branches`).

:func:`run_bench` is generic (any Trainer factory); :func:`bench_gpt` is the GPT recipe's. The
result types (:class:`Row`, :class:`Bench`) and the prediction beside each row are in
:mod:`jaxmp.tools.bench_rows`.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jaxmp._util.arrays import tree_bytes
from jaxmp._util.fmt import fmt_bytes, mesh_str
from jaxmp.config import TrainerConfig, replace
from jaxmp.data import to_global
from jaxmp.errors import BadInput
from jaxmp.hlo import KINDS
from jaxmp.mesh import resolve_axes
from jaxmp.plan import Plan, make_plan
from jaxmp.recipes.gpt import gpt_config, gpt_plan, gpt_trainer
from jaxmp.tools.aot import captured_stderr, remat_shortfall
from jaxmp.tools.bench_rows import Bench, Row, predicted_row, with_errors
from jaxmp.tools.measure import executed_collectives, measure_step
from jaxmp.tools.strategies import StrategySpec, full_mesh
from jaxmp.train import Trainer
from jaxmp.train.metrics import batch_tokens, total_peak_flops
from jaxmp.train.state import init_state
from jaxmp.train.step import batch_spec

MakeTrainer = Callable[[TrainerConfig, list, Plan], Trainer]  # (config, devices, its plan)
PlanFor = Callable[[TrainerConfig], Plan]  # the one planning function, on this bench's devices
# ------------------------------------------------------------------------------ the planner


def _planned(plan_for: PlanFor, config: TrainerConfig, mesh: dict[str, Any]) -> Plan:
    return plan_for(replace(config, mesh=full_mesh(mesh, "auto")))


def plan_strategy(spec: StrategySpec, plan_for: PlanFor, config: TrainerConfig, n: int
                  ) -> tuple[dict[str, int] | None, Plan | None, str]:
    """(mesh, the plan, why it cannot run — "" if it can) for ``spec`` on ``n`` devices.

    ``auto`` is the config as it is; ``stage`` the best plan (fitting first, then fastest)
    among those with ``mesh.stage`` fixed to each divisor > 1 of ``n``; a recipe or explicit
    sizes fix the whole mesh. Everything else comes from ``config``."""
    try:
        if spec.planned == "auto":
            plan = plan_for(config)
        elif spec.planned == "stage":
            plans, why = [], []
            for stages in (k for k in range(2, n + 1) if n % k == 0):
                try:
                    plans.append(_planned(plan_for, config, {"stage": stages}))
                except BadInput as e:
                    why.append(f"stage={stages}: {e}")
            runnable = [p for p in plans if p.runnable] or plans
            if not runnable:
                return None, None, (f"no pipeline layout of {n} device(s) is possible: "
                                    + "; ".join(why[:2]))
            plan = min(runnable, key=lambda p: (not p.fits, p.predicted.step_time_s))
        else:
            mesh = resolve_axes(spec.mesh(n), n)
            plan = _planned(plan_for, config, mesh)
    except (BadInput, ValueError) as e:
        mesh = None
        if not spec.planned:
            try:
                mesh = resolve_axes(spec.mesh(n), n)
            except ValueError:
                pass
        return mesh, None, str(e)
    return plan.mesh, plan, "; ".join(plan.blockers)


# ------------------------------------------------------------------------------ measuring


def random_batch(example: dict, seed: int = 0, high: int = 2) -> dict[str, np.ndarray]:
    """A global batch shaped like ``example``: integers in [0, high), floats standard normal."""
    rng = np.random.default_rng(seed)
    out = {}
    for k, v in example.items():
        if np.issubdtype(np.dtype(v.dtype), np.integer):
            out[k] = rng.integers(0, high, v.shape).astype(v.dtype)
        else:
            out[k] = rng.standard_normal(v.shape).astype(v.dtype)
    return out


def time_steps(step: Callable, state: Any, batch: dict, steps: int, warmup: int
               ) -> tuple[list[float], float, Any]:
    """Run ``warmup`` then ``steps`` steps, each timed to completion; (seconds, final loss,
    the final state)."""
    metrics: Any = None
    for _ in range(warmup):
        state, metrics = step(state, batch)
    jax.block_until_ready((state, metrics))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - start)
    return times, float(metrics["loss"]), state


def _memory_limit(device: Any, plan: Plan | None) -> float:
    """Bytes one device may use: what the runtime reports, else the planner's limit."""
    try:
        stats = device.memory_stats() or {}
    except Exception:  # noqa: BLE001 - not every backend reports memory
        stats = {}
    return float(stats.get("bytes_limit") or (plan.memory_limit if plan and plan.memory_limit
                                               else float("inf")))


def measure_row(row: Row, trainer: Trainer, batch: dict, steps: int, warmup: int,
                limit: float, model_flops: float, peak: float, compile_only: str = "") -> None:
    """Compile ``trainer``'s step, read memory and collectives, time it on ``batch``, then run
    one more step under the profiler for the collectives each device executed.
    ``compile_only``: why the step is compiled but not run (deviceless GPUs: ``--aot``); then
    The fit verdict is the compiled peak's (what the runtime allocates); XLA's
    rematerialization warning is kept on the row as information, as in ``jaxmp plan --aot``."""
    start = time.perf_counter()
    with captured_stderr() as said:
        m = measure_step(trainer)
    row.compile_s = time.perf_counter() - start
    short = remat_shortfall(said)
    others = [line for line in said if remat_shortfall([line]) is None]
    if others:  # not ours to swallow
        print("\n".join(others), file=sys.stderr)
    row.argument_bytes, row.temp_bytes = m.argument_bytes, m.temp_bytes
    row.peak_bytes = m.peak_bytes
    row.collective_bytes = {k: float(m.one_branch.get(k, 0.0)) for k in KINDS}
    row.collective_bytes_static = m.collective_bytes
    row.collective_bytes_raw = float(m.collectives.raw_total_bytes)
    row.collectives_from = "static"
    row.xla_rematerialization = short
    if m.peak_bytes > limit:
        row.status = "compiled only"
        row.reason = (f"does not fit: compiled peak {fmt_bytes(m.peak_bytes)} > "
                      f"{fmt_bytes(limit)} per device")
        return
    if compile_only:
        row.status, row.reason = "compiled only", compile_only
        return
    spec = batch_spec(trainer.mesh, trainer.rules, next(iter(batch.values())).shape[0])
    on_mesh = to_global(batch, trainer.mesh, spec)
    state = init_state(trainer.layout, trainer.model_fn, trainer.tx, trainer.config.train.seed)
    row.step_times_s, row.loss, state = time_steps(m.compiled, state, on_mesh, steps, warmup)
    _, executed = executed_collectives(m, state, on_mesh)
    if executed is not None:
        row.collective_bytes = {k: float(executed.get(k, 0.0)) for k in KINDS}
        row.collectives_from = "executed"
    dt = row.step_time_s
    row.tokens_per_s = batch_tokens(batch) / dt
    row.model_flops_per_s = model_flops / dt
    row.mfu = row.model_flops_per_s / peak


AOT_REASON = ("compiled for deviceless GPUs (--aot): memory and bytes are the GPU program's; "
              "time is not measurable without a GPU (the step time is the planner's)")


def _failure(e: Exception) -> str:
    text = str(e).strip().splitlines()
    msg = text[0] if text else type(e).__name__
    if "RESOURCE_EXHAUSTED" in str(e) or "out of memory" in str(e).lower():
        return f"out of memory: {msg[:200]}"
    return f"failed: {type(e).__name__}: {msg[:200]}"


def default_planner(trainer: Trainer, n: int) -> PlanFor:
    """The planning function for any model: :func:`jaxmp.plan.make_plan` with ``trainer``'s
    costs (traced from its example batch), rules, pipeline spec and compute dtype."""
    return lambda cfg: make_plan(cfg, trainer.costs.get(), n, rules=trainer.rules,
                                 pipeline=trainer.pipeline is not None,
                                 stack_blocks=trainer.stack_blocks,
                                 compute_dtype=trainer.compute_dtype, remat=trainer.plan.remat,
                                 measure_cpu=True)


def run_bench(config: TrainerConfig, make_trainer: MakeTrainer, specs: Sequence[StrategySpec],
              devices: Sequence[Any], *, plan_for: PlanFor | None = None,
              batch: dict | None = None, model_flops_per_step: float | None = None,
              steps: int = 10, warmup: int = 2,
              log: Callable[[str], None] = lambda s: None, compile_only: str = "") -> Bench:
    """Measure every strategy in ``specs`` on ``devices``.

    ``make_trainer(config, devices, plan)`` builds the Trainer that runs ``plan`` (its config's
    ``[mesh]`` is the strategy's); ``plan_for(config)`` plans a strategy's config on these
    devices (default: :func:`default_planner` of a Trainer built data-parallel); ``batch`` a
    global batch of numpy arrays (default: random, shaped like the example batch);
    ``model_flops_per_step`` the model FLOPs behind MFU (default: the planner's cost without
    recomputation); ``compile_only``: compile each strategy without running it, saying why
    (deviceless GPUs).
    """
    devices = list(devices)
    n = len(devices)
    first: Trainer | None = None
    if plan_for is None or batch is None:
        first = make_trainer(replace(config, mesh=full_mesh({"data": n})), devices, None)
        if first.example_batch is None:
            raise ValueError("jaxmp bench needs a Trainer with an example_batch")
        plan_for = plan_for or default_planner(first, n)
        if batch is None:
            batch = random_batch(first.example_batch, config.train.seed)
    peak = total_peak_flops(devices)
    tokens = batch_tokens(batch)
    rows: list[Row] = []
    plans: list[Plan | None] = []
    param_bytes = float("nan")
    for spec in specs:
        mesh, plan, why = plan_strategy(spec, plan_for, config, n)
        row = Row(spec.name, mesh=mesh)
        if plan is not None:
            if model_flops_per_step is None and plan.predicted is not None:
                model_flops_per_step = plan.predicted.flops_per_step - sum(
                    lay["recompute_flops"].get(plan.remat, 0.0) for lay in plan.layers)
            row.predicted = predicted_row(plan, tokens, model_flops_per_step or float("nan"),
                                       peak)
            row.layout = plan.layout.to_json()
        earlier = next((r for r, p in zip(rows, plans) if plan is not None and p is not None
                        and p.layout == plan.layout and not r.same_as), None)
        if why or plan is None:
            row.status, row.reason = "not run", why or "the planner found no layout"
        elif earlier is not None:
            row = dataclasses.replace(earlier, name=spec.name, same_as=earlier.name,
                                      predicted=row.predicted)
        else:
            log(f"jaxmp bench: {spec.name} ({mesh_str(mesh)})")
            trainer = None
            try:
                cfg = replace(config, mesh=full_mesh(plan.mesh))
                trainer = first if first is not None and first.plan.layout == plan.layout \
                    else make_trainer(cfg, devices, plan)
                built = trainer.executed_layout().differences(plan.layout)
                if built:
                    raise RuntimeError("the Trainer built another layout: " + "; ".join(built))
                if math.isnan(param_bytes):  # the model's, as the first layout holds them
                    param_bytes = float(tree_bytes(trainer.layout.abstract.params))
                measure_row(row, trainer, batch, steps, warmup,
                            _memory_limit(devices[0], plan), model_flops_per_step or
                            float("nan"), peak, compile_only)
            except Exception as e:  # noqa: BLE001 - one strategy failing is a row, not a crash
                row.status, row.reason = "not run", _failure(e)
            finally:
                trainer = None
                gc.collect()
        with_errors(row)
        rows.append(row)
        plans.append(plan)
    first = None
    return Bench(rows, n, devices[0].platform, devices[0].device_kind, peak, tokens,
                 model_flops_per_step or float("nan"), steps, warmup, param_bytes)


def bench_gpt(config: Any, specs: Sequence[StrategySpec], devices: Sequence[Any],
              steps: int = 10, warmup: int = 2, log: Callable[[str], None] = lambda s: None,
              device_kind: str | None = None, aot: bool = False) -> Bench:
    """``jaxmp bench``: the configured GPT, its planner costs and a random token batch.
    ``aot``: ``devices`` are deviceless GPUs of ``device_kind``; each strategy's step is
    compiled by XLA's GPU compiler here, not run (``jaxmp bench --aot``)."""
    gcfg = gpt_config(config)
    shape = (config.train.batch_size, config.data.seq_len)
    rng = np.random.default_rng(config.train.seed)
    tokens = rng.integers(0, gcfg.vocab_size, (shape[0], shape[1] + 1), dtype=np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    n = len(devices)
    result = run_bench(
        config, lambda cfg, devs, plan: gpt_trainer(cfg, devices=devs, with_data=False,
                                                    plan=plan), specs, devices,
        plan_for=lambda cfg: gpt_plan(cfg, n, device_kind, measure_cpu=not aot,
                                      platform="cuda" if aot else None), batch=batch,
        model_flops_per_step=gcfg.flops_per_token(shape[1]) * shape[0] * shape[1],
        steps=steps, warmup=warmup, log=log,
        compile_only=AOT_REASON if aot else "")
    result.description = {"model": {"layers": gcfg.layers, "d_model": gcfg.d_model,
                                    "heads": gcfg.heads, "vocab_size": gcfg.vocab_size,
                                    "compute_dtype": gcfg.compute_dtype,
                                    "remat": config.model.remat},
                          "global_batch": {"sequences": shape[0], "seq_len": shape[1]}}
    return result
