"""The training loop, top to bottom: mesh → state → step → data → metrics → checkpoints.

``Trainer`` trains any Flax NNX model; ``jaxmp train`` is this same class with the GPT, its
loss and the built-in data (see ``jaxmp.recipes``), so there is no second code path.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import jax
import numpy as np

from jaxmp import rules as rules_lib
from jaxmp.ckpt.resume import Preemption, TrainCheckpointer, resume_iterator, say
from jaxmp.config import Config, ConfigError, config_to_toml
from jaxmp.data import to_global
from jaxmp.mesh import make_mesh, mesh_shape
from jaxmp.metrics import MetricsWriter, Progress, total_peak_flops
from jaxmp.train.state import (OptimizerSpec, TrainState, init_state, make_optimizer,
                               make_schedule, plan_state, state_bytes)
from jaxmp.train.step import LossFn, batch_spec, make_eval_step, make_train_step


def optimizer_spec(config: Config) -> OptimizerSpec:
    o = config.optimizer
    return OptimizerSpec(lr=o.lr, min_lr_ratio=o.min_lr_ratio, warmup_steps=o.warmup_steps,
                         weight_decay=o.weight_decay, beta1=o.beta1, beta2=o.beta2, eps=o.eps,
                         clip_norm=o.clip_norm)


def mesh_for(config: Config, devices: Sequence[jax.Device] | None = None,
             plan: dict | None = None) -> jax.sharding.Mesh:
    """The mesh the config asks for; with ``mesh`` all ``auto``, the plan's (else data-parallel)."""
    devices = list(devices if devices is not None else jax.devices())
    sizes = plan["mesh"] if plan is not None and config.mesh.is_auto else config.mesh.sizes()
    try:
        return make_mesh(sizes, devices)
    except ValueError as e:  # a config that cannot fit the devices is bad input, not a crash
        raise ConfigError(f"mesh: {e}") from None


class Trainer:
    """Train a Flax NNX model on a mesh with one jit step; checkpoints, metrics and resume.

    ``model_fn(rngs)`` builds the model; ``loss_fn(model, batch)`` returns a scalar loss or
    ``(loss, aux)``; ``data`` yields this process's rows of each global batch as numpy dicts.
    ``rules`` are tried before the defaults (first match wins), ``path_rules`` name the axes of
    parameters that carry no logical-name metadata. ``plan`` (``Plan.to_json()`` from
    ``jaxmp.planner``) supplies the mesh when the config leaves it on ``auto`` and is written to
    ``plan.json``; given instead an ``example_batch`` (global shapes: arrays or
    ShapeDtypeStructs), the Trainer plans the model itself; with neither, an ``auto`` mesh is
    plain data parallelism.
    """

    def __init__(self, config: Config, model_fn: Callable, loss_fn: LossFn,
                 data: Iterable[dict], *, rules: Sequence | None = None,
                 path_rules: Sequence | None = None, run_dir: str | os.PathLike = "runs/default",
                 eval_data: Callable[[], Iterable[dict]] | None = None,
                 model_flops_per_token: float | None = None,
                 devices: Sequence[jax.Device] | None = None, plan: dict | None = None,
                 example_batch: Any = None):
        self.config = config
        self.model_fn = model_fn
        self.loss_fn = loss_fn
        self.data = data
        self.eval_data = eval_data
        self.path_rules = path_rules
        self.run_dir = Path(run_dir)
        self.flops_per_token = model_flops_per_token
        self.rules = tuple(rules or ()) + tuple(rules_lib.DEFAULT_RULES)
        if plan is None and example_batch is not None and config.mesh.is_auto:
            from jaxmp.planner import plan_for_model

            n = len(devices) if devices is not None else jax.device_count()
            plan = plan_for_model(model_fn, example_batch, n, loss_fn=loss_fn, rules=self.rules,
                                  grad_accum=config.train.grad_accum).to_json()
        self.plan = plan
        self.mesh = mesh_for(config, devices, plan)
        self.is_main = jax.process_index() == 0
        self.tx = make_optimizer(optimizer_spec(config), config.train.steps)
        self.schedule = make_schedule(optimizer_spec(config), config.train.steps)
        self.layout = plan_state(model_fn, self.tx, self.mesh, self.rules, path_rules)
        self.state: TrainState | None = None
        self.history: list[dict] = []

    # -- set-up -------------------------------------------------------------------------------
    def _write_run_files(self) -> None:
        if not self.is_main:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        _atomic_write(self.run_dir / "config.toml", config_to_toml(self.config))
        lint = rules_lib.lint(self.layout.abstract.params, self.mesh, rules=self.rules,
                              path_rules=self.path_rules)
        plan = {"mesh": mesh_shape(self.mesh), "devices": len(self.mesh.devices.flat),
                "processes": jax.process_count(),
                "param_bytes": state_bytes(self.layout.abstract.params),
                "state_bytes": state_bytes(self.layout.abstract),
                "lint": lint.to_dict()}
        if self.plan is not None:
            plan.update(self.plan)
        _atomic_write(self.run_dir / "plan.json", json.dumps(plan, indent=2, default=str) + "\n")

    def _flops_per_step(self, compiled: Any, tokens: int) -> float:
        if self.flops_per_token is not None:
            return self.flops_per_token * tokens
        try:  # any model: XLA's count for the compiled step (per device, scans counted once)
            cost = compiled.cost_analysis()
            cost = cost[0] if isinstance(cost, (list, tuple)) else cost
            return float(cost.get("flops", float("nan"))) * self.mesh.size
        except Exception:  # noqa: BLE001 - MFU is informative, never fatal
            return float("nan")

    # -- the loop -----------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        cfg, t = self.config, self.config.train
        self._write_run_files()
        ckpt = TrainCheckpointer(self.run_dir, cfg, self.layout, self.path_rules)
        resumed = ckpt.restore() if self.state is None else None  # newest readable checkpoint
        if resumed is not None:
            self.state = resumed.state
        elif self.state is None:
            self.state = init_state(self.layout, self.model_fn, self.tx, t.seed)
        start_step = int(self.state.step)
        data_iter = resume_iterator(self.data, resumed)  # continues the stream after a resume
        batch = self._next_global(data_iter)
        # Compiled once, ahead of time: the same executable runs the steps and reports its cost.
        step_fn = make_train_step(self.layout, self.loss_fn, self.tx, self.schedule, batch,
                                  t.grad_accum, self.rules).lower(self.state, batch).compile()
        eval_fn = make_eval_step(self.layout, self.loss_fn, batch, self.rules) \
            if self.eval_data is not None and t.eval_every > 0 else None
        tokens = int(np.prod(batch["inputs"].shape)) if "inputs" in batch else \
            int(jax.tree.leaves(batch)[0].shape[0])
        flops = self._flops_per_step(step_fn, tokens)
        peak = total_peak_flops(list(self.mesh.devices.flat))
        writer = MetricsWriter(self.run_dir, self.is_main, cfg.logging.tensorboard)
        progress = Progress(t.steps, self.is_main and cfg.logging.progress)
        progress.message(f"jaxmp: mesh {_mesh_str(self.mesh)} on {self.mesh.size} "
                         f"{self.mesh.devices.flat[0].platform} device(s); "
                         f"{state_bytes(self.layout.abstract.params) / 2**20:.1f} MiB params; "
                         f"steps {start_step}..{t.steps}; run dir {self.run_dir}")
        profile = _Profiler(cfg.logging.profile_steps, self.run_dir, self.is_main)
        last_log, last_time, metrics = start_step, time.perf_counter(), {}
        preempt = Preemption().install()  # stop cleanly even with checkpoints off
        try:
            for step in range(start_step, t.steps):
                profile.maybe_start(step)
                if step > start_step:
                    batch = self._next_global(data_iter)
                self.state, metrics = step_fn(self.state, batch)
                done = step + 1
                profile.maybe_stop(done)
                stop = preempt.requested(done)  # SIGTERM/SIGINT: save here, then stop
                if done % cfg.logging.every == 0 or done == t.steps or stop:
                    loss = float(metrics["loss"])  # blocks: timing covers real work
                    now = time.perf_counter()
                    dt = (now - last_time) / max(done - last_log, 1)
                    record = {"loss": loss, "tokens_per_s": tokens / dt, "step_time_s": dt,
                              "model_flops_per_step": flops, "mfu": flops / dt / peak,
                              "grad_norm": float(metrics["grad_norm"]),
                              "lr": float(metrics["lr"])}
                    if eval_fn is not None and (done % t.eval_every == 0 or done == t.steps):
                        record["eval_loss"] = self.evaluate(eval_fn)
                    writer.write(done, record)
                    self.history.append({"step": done, **record})
                    progress.update(done, loss, record["tokens_per_s"])
                    last_log, last_time = done, time.perf_counter()
                ckpt.maybe_save(done, self.state, data_iter, force=stop or done == t.steps)
                if stop:
                    where = f"checkpoint saved in {ckpt.dir}" if ckpt.enabled else \
                        "checkpoints are disabled, nothing saved"
                    say(f"jaxmp: stopped by {preempt.reason} at step {done}; {where}")
                    break
        finally:
            preempt.close()
            ckpt.close()  # waits for the last async save to be committed
            profile.close()
            progress.close()
            writer.close()
        return self.history[-1] if self.history else {}

    def evaluate(self, eval_fn: Callable) -> float:
        losses = [float(eval_fn(self.state, self._to_global(b)))
                  for _, b in zip(range(self.config.train.eval_batches), self.eval_data())]
        return float(np.mean(losses)) if losses else float("nan")

    def _next_global(self, it) -> dict:
        try:
            return self._to_global(next(it))
        except StopIteration:
            raise RuntimeError("the data iterator ran out before train.steps was reached") from None

    def _to_global(self, batch: dict) -> dict:
        return to_global(batch, self.mesh,
                         batch_spec(self.mesh, self.rules, self.config.train.batch_size))


class _Profiler:
    """A jax.profiler trace over the step range [start, stop), written under the run dir."""

    def __init__(self, steps: Sequence[int], run_dir: Path, enabled: bool):
        self.range = tuple(steps) if steps else None
        self.dir = run_dir / "profile"
        self.enabled = enabled and self.range is not None
        self.active = False

    def maybe_start(self, step: int) -> None:
        if self.enabled and not self.active and step == self.range[0]:
            jax.profiler.start_trace(str(self.dir))
            self.active = True

    def maybe_stop(self, done: int) -> None:
        if self.active and done >= self.range[1]:
            self.close()

    def close(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active = False


def _mesh_str(mesh: jax.sharding.Mesh) -> str:
    parts = [f"{k}{v}" for k, v in mesh_shape(mesh).items() if v > 1]
    return "×".join(parts) or "single-device"


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
