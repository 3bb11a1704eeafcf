"""``jaxmp bench``: parallelism strategies side by side, measured, beside the planner's predictions.

Every strategy trains the same model on the same global batch through the same step builder as
``jaxmp train`` (``Trainer.compile``). For each: per-device memory from the compiled program
(argument, temp, peak), the bytes each device sends per step by collective kind (from the
optimized HLO), the median step time over K timed steps after warm-up on a real batch of the
right shape, tokens/s, model FLOP/s and MFU (against the devices' peak; on CPU against a large
matmul measured in this process), and the planner's prediction for the same layout with the
relative error of each figure. A strategy that cannot run gets a row that says why: the same
checks the planner applies (divisibility, pipeline stages not yet executable), a mesh that needs
other devices, a compiled peak above device memory, or the error it failed with.

:func:`run_bench` is generic (any Trainer factory); :func:`bench_gpt` is the GPT recipe's.
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from jaxmp import sharding
from jaxmp._util.arrays import tree_bytes
from jaxmp._util.fmt import fmt_bytes, mesh_str
from jaxmp.config import TrainerConfig, replace
from jaxmp.cost import ModelCost, model_costs
from jaxmp.data import to_global
from jaxmp.devices import profile_from_config
from jaxmp.hlo import KINDS
from jaxmp.mesh import resolve_axes
from jaxmp.plan import Context
from jaxmp.plan.search import Candidate, choose, search
from jaxmp.recipes.gpt import gpt_config, gpt_costs, gpt_trainer
from jaxmp.tools.measure import measure_step, rel_err
from jaxmp.tools.strategies import StrategySpec, full_mesh
from jaxmp.train import Trainer
from jaxmp.train.metrics import batch_tokens, total_peak_flops
from jaxmp.train.state import init_state
from jaxmp.train.step import batch_spec

MakeTrainer = Callable[[TrainerConfig, list], Trainer]  # (config with the mesh, devices)
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
    compile_s: float | None = None
    step_times_s: list[float] = field(default_factory=list)
    tokens_per_s: float | None = None
    model_flops_per_s: float | None = None
    mfu: float | None = None
    loss: float | None = None
    predicted: dict[str, Any] | None = None

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
                "compile_s": self.compile_s, "step_time_s": self.step_time_s,
                "step_time_min_s": min(t) if t else None,
                "step_time_max_s": max(t) if t else None,
                "tokens_per_s": self.tokens_per_s, "model_flops_per_s": self.model_flops_per_s,
                "mfu": self.mfu, "loss": self.loss, "predicted": self.predicted}


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


# ------------------------------------------------------------------------------ the planner


def _pick(cands: Sequence[Candidate]) -> Candidate | None:
    """The candidate the trainer would run: a runnable one if any, else the fastest."""
    return next((c for c in cands if c.runnable), cands[0] if cands else None)


def planned_layout(spec: StrategySpec, ctx: Context, config: TrainerConfig, remat: str
                   ) -> tuple[dict[str, int] | None, Candidate | None, str]:
    """(mesh, the planner's candidate, why it cannot run — "" if it can) for ``spec``.

    Uses the planner's own search, so what it cannot run (indivisible batches, axes that shard
    nothing, pipeline stages while they are not executed) gets the planner's reason here too.
    """
    n, ga = ctx.n, 1 if config.train.microbatches == "auto" else config.train.microbatches
    if spec.planned:
        fixed = {a: v for a, v in config.mesh.explicit().items() if v != -1} \
            if spec.planned == "auto" else None
        result = search(ctx, fixed, (remat,), ga, remat)
        if spec.planned == "auto":
            best, _ = choose(result)
            if best is None:
                return None, None, "the planner found no runnable layout"
            return best.mesh, best, ""
        cand = _pick([c for c in result.ranked if c.mesh["stage"] > 1])
        if cand is None:
            return None, None, f"no pipeline layout of {n} device(s) is possible"
        return cand.mesh, cand, "; ".join(cand.blockers)
    try:
        mesh = resolve_axes(spec.mesh(n), n)
    except ValueError as e:
        return None, None, str(e)
    result = search(ctx, mesh, (remat,), ga, remat)
    cand = _pick(result.ranked)
    if cand is None:
        return mesh, None, "; ".join(result.dropped) or "the planner dropped this layout"
    return mesh, cand, "; ".join(cand.blockers)


def _predicted(cand: Candidate, tokens: int, model_flops: float, peak: float) -> dict:
    p = cand.prediction
    step = p.step_time_s
    return {"argument_bytes": p.argument_bytes, "temp_bytes": p.per_device_bytes - p.argument_bytes,
            "peak_bytes": p.per_device_bytes, "collective_bytes_total": p.comm_bytes_per_step,
            "collective_bytes_by_axis": {a: v for a, v in p.comm_bytes.items() if v},
            "step_time_s": step, "tokens_per_s": tokens / step if step else None,
            "mfu": model_flops / step / peak if step else None, "fits": cand.fits,
            "stages": [list(s) for s in p.stages], "microbatches": cand.layout.microbatches,
            "remat": cand.layout.remat}


def _with_errors(row: Row) -> None:
    if row.predicted is None:
        return
    errs = {}
    for key in COMPARED:
        measured, predicted = getattr(row, key), row.predicted.get(key)
        if measured is not None and predicted is not None:
            errs[key] = rel_err(predicted, measured)
    row.predicted["rel_err"] = errs


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
               ) -> tuple[list[float], float]:
    """Run ``warmup`` then ``steps`` steps, each timed to completion; (seconds, final loss)."""
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
    return times, float(metrics["loss"])


def _memory_limit(device: Any, ctx: Context) -> float:
    """Bytes one device may use: what the runtime reports, else the planner's limit."""
    try:
        stats = device.memory_stats() or {}
    except Exception:  # noqa: BLE001 - not every backend reports memory
        stats = {}
    return float(stats.get("bytes_limit") or ctx.memory_limit)


def measure_row(row: Row, trainer: Trainer, batch: dict, steps: int, warmup: int,
                limit: float, model_flops: float, peak: float) -> None:
    """Compile ``trainer``'s step, read memory and collectives, then time it on ``batch``."""
    start = time.perf_counter()
    m = measure_step(trainer)
    row.compile_s = time.perf_counter() - start
    row.argument_bytes, row.temp_bytes = m.argument_bytes, m.temp_bytes
    row.peak_bytes = m.peak_bytes
    row.collective_bytes = {k: float(m.collectives.bytes_by_kind.get(k, 0.0)) for k in KINDS}
    row.collective_bytes_raw = float(m.collectives.raw_total_bytes)
    if m.peak_bytes > limit:
        row.status = "compiled only"
        row.reason = (f"does not fit: compiled peak {fmt_bytes(m.peak_bytes)} > "
                      f"{fmt_bytes(limit)} per device")
        return
    spec = batch_spec(trainer.mesh, trainer.rules, next(iter(batch.values())).shape[0])
    on_mesh = to_global(batch, trainer.mesh, spec)
    state = init_state(trainer.layout, trainer.model_fn, trainer.tx, trainer.config.train.seed)
    row.step_times_s, row.loss = time_steps(m.compiled, state, on_mesh, steps, warmup)
    dt = row.step_time_s
    row.tokens_per_s = batch_tokens(batch) / dt
    row.model_flops_per_s = model_flops / dt
    row.mfu = row.model_flops_per_s / peak


def _failure(e: Exception) -> str:
    text = str(e).strip().splitlines()
    msg = text[0] if text else type(e).__name__
    if "RESOURCE_EXHAUSTED" in str(e) or "out of memory" in str(e).lower():
        return f"out of memory: {msg[:200]}"
    return f"failed: {type(e).__name__}: {msg[:200]}"


def run_bench(config: TrainerConfig, make_trainer: MakeTrainer, specs: Sequence[StrategySpec],
              devices: Sequence[Any], *, cost: ModelCost | None = None,
              batch: dict | None = None, rules: Sequence | None = None,
              model_flops_per_step: float | None = None, steps: int = 10, warmup: int = 2,
              log: Callable[[str], None] = lambda s: None) -> Bench:
    """Measure every strategy in ``specs`` on ``devices``.

    ``make_trainer(config, devices)`` builds the Trainer for a config whose ``[mesh]`` is the
    strategy's; ``cost`` is the model's :class:`~jaxmp.cost.ModelCost` for the predictions
    (default: traced from the first Trainer's model and example batch); ``batch`` a global
    batch of numpy arrays (default: random, shaped like the example batch); ``rules`` the
    Trainer's rule list, for the predictions (default: the first Trainer's, else
    ``DEFAULT_RULES``); ``model_flops_per_step`` the model FLOPs behind MFU (default: the traced
    cost without recomputation).
    """
    devices = list(devices)
    n = len(devices)
    profile = profile_from_config(config.device, strict=False, measure_cpu=True)
    first: Trainer | None = None
    if cost is None or batch is None:
        first = make_trainer(replace(config, mesh=full_mesh({"data": n})), devices)
        example = first.example_batch
        if example is None:
            raise ValueError("jaxmp bench needs a Trainer with an example_batch")
        if cost is None:
            cost = model_costs(first.model_fn, example, first.loss_fn, first.tx,
                               policies=("none",), path_rules=first.path_rules)
        if batch is None:
            batch = random_batch(example, config.train.seed)
    if rules is None:  # the Trainer's own, when one was built
        rules = first.rules if first is not None else sharding.DEFAULT_RULES
    ctx = Context(cost, profile, n, sharding.normalize_rules(rules))
    remat = cost.runs_as
    peak = total_peak_flops(devices)
    tokens = batch_tokens(batch)
    model_flops = model_flops_per_step or cost.flops_per_step("none")
    limit = _memory_limit(devices[0], ctx)
    rows: list[Row] = []
    param_bytes = float("nan")
    for spec in specs:
        mesh, cand, why = planned_layout(spec, ctx, config, remat)
        row = Row(spec.name, mesh=mesh)
        if cand is not None:
            row.predicted = _predicted(cand, tokens, model_flops, peak)
        earlier = next((r for r in rows if r.mesh == mesh and not r.same_as), None)
        if why or mesh is None:
            row.status, row.reason = "not run", why
        elif earlier is not None:
            row = dataclasses.replace(earlier, name=spec.name, same_as=earlier.name,
                                      predicted=row.predicted)
        else:
            log(f"jaxmp bench: {spec.name} ({mesh_str(mesh)})")
            try:
                trainer = first if first is not None and first.mesh.shape == mesh \
                    else make_trainer(replace(config, mesh=mesh), devices)
                param_bytes = float(tree_bytes(trainer.layout.abstract.params))
                measure_row(row, trainer, batch, steps, warmup, limit, model_flops, peak)
            except Exception as e:  # noqa: BLE001 - one strategy failing is a row, not a crash
                row.status, row.reason = "not run", _failure(e)
            finally:
                trainer = None
                gc.collect()
        _with_errors(row)
        rows.append(row)
    first = None
    return Bench(rows, n, devices[0].platform, devices[0].device_kind, peak, tokens,
                 model_flops, steps, warmup, param_bytes)


def bench_gpt(config: Any, specs: Sequence[StrategySpec], devices: Sequence[Any],
              steps: int = 10, warmup: int = 2, log: Callable[[str], None] = lambda s: None
              ) -> Bench:
    """``jaxmp bench``: the configured GPT, its planner costs and a random token batch."""
    gcfg = gpt_config(config)
    shape = (config.train.batch_size, config.data.seq_len)
    rng = np.random.default_rng(config.train.seed)
    tokens = rng.integers(0, gcfg.vocab_size, (shape[0], shape[1] + 1), dtype=np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    result = run_bench(
        config, lambda cfg, devs: gpt_trainer(cfg, devices=devs, with_data=False), specs,
        devices, cost=gpt_costs(config, (config.model.remat,)), batch=batch,
        model_flops_per_step=gcfg.flops_per_token(shape[1]) * shape[0] * shape[1],
        steps=steps, warmup=warmup, log=log)
    result.description = {"model": {"layers": gcfg.layers, "d_model": gcfg.d_model,
                                    "heads": gcfg.heads, "vocab_size": gcfg.vocab_size,
                                    "compute_dtype": gcfg.compute_dtype,
                                    "remat": config.model.remat},
                          "global_batch": {"sequences": shape[0], "seq_len": shape[1]}}
    return result
