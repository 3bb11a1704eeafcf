"""The training loop, top to bottom: plan → mesh → state → step → data → metrics → checkpoints.

``Trainer`` trains any Flax NNX model; ``jaxmp train`` is this same class with the GPT, its
loss and the built-in data (see :mod:`jaxmp.recipes.gpt`), so there is no second code path.
"""

from __future__ import annotations

import functools
import json
import os
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxmp import sharding
from jaxmp._util.arrays import tree_bytes
from jaxmp._util.env import VERSIONED_GPU_FLAGS, gpu_compile_options, platform_note
from jaxmp._util.fmt import fmt_bytes, mesh_str
from jaxmp._util.io import atomic_write, make_dir
from jaxmp._util.log import say
from jaxmp.compression.reduce import Compression, without_data
from jaxmp.config import TrainerConfig, config_to_toml
from jaxmp.cost import ModelCost
from jaxmp.data import to_global
from jaxmp.errors import ConfigError
from jaxmp.mesh import make_mesh, mesh_shape
from jaxmp.pipeline.chunk import PipelineSpec, stack_length, to_stages
from jaxmp.pipeline.executor import PipelineExecutor
from jaxmp.plan import Layout, Plan
from jaxmp.plan.layout import mesh_items
from jaxmp.plan.make import refuse_unnamed_sequence
from jaxmp.train import checks, guard, master, peers, wire, zero
from jaxmp.train.checkpointing import TrainCheckpointer, resume_iterator
from jaxmp.train.metrics import (MetricsWriter, Profiler, Progress, batch_tokens,
                                 memory_metrics, total_peak_flops)
from jaxmp.train.optimizer import make_optimizer, make_schedule
from jaxmp.train.planning import (CostSource, Stages, attention_of, check_plan, plan_run,
                                  remat_of, split_of)
from jaxmp.train.preempt import Preemption
from jaxmp.train.state import Extension, TrainState, init_state, plan_state
from jaxmp.train.step import LossFn, batch_spec, make_eval_step, make_train_step


GPU_PLATFORMS = ("gpu", "cuda", "rocm")
_UNKNOWN_OPTION = re.compile(r"No such compile option: '([\w.]+)'")
_UNKNOWN_OPTIONS: set[str] = set()  # flags this jaxlib's XLA does not have (asked once each)


def compile_with_options(lowered: Any, options: dict[str, Any]) -> Any:
    """``lowered.compile(compiler_options=options)`` without the options this XLA does not
    know: XLA's flags come and go between versions (jaxlib 0.12 spells collective pipelining
    ``xla_gpu_pipeline_*``, jaxlib 0.10 ``xla_gpu_enable_pipelined_*``), and an unknown one
    fails the compile, so each is dropped once, with one line saying so (none for jaxmp's own
    :data:`~jaxmp._util.env.VERSIONED_GPU_FLAGS`)."""
    while True:
        kept = {k: v for k, v in options.items() if k not in _UNKNOWN_OPTIONS}
        try:
            return lowered.compile(compiler_options=kept) if kept else lowered.compile()
        except Exception as e:  # noqa: BLE001 - jaxlib raises its own runtime error type
            found = _UNKNOWN_OPTION.search(str(e))
            if found is None or found[1] not in kept:
                raise
            _UNKNOWN_OPTIONS.add(found[1])
            if found[1] not in VERSIONED_GPU_FLAGS:  # jaxmp's other-version spelling: quiet
                say(f"jaxmp: this XLA has no flag --{found[1]}; compiling without it")


class Trainer:
    """Train a Flax NNX model on a mesh with one jit step; checkpoints, metrics and resume.

    ``model_fn(rngs)`` builds the model; ``loss_fn(model, batch)`` — or ``loss_fn(model,
    batch, rngs)`` for fresh per-step randomness (dropout) — returns a scalar loss or ``(loss,
    aux)``; ``data`` yields this process's rows of each global batch as numpy dicts.
    ``rules`` is the complete ordered rule list, as everywhere in jaxmp (default
    ``rules.DEFAULT_RULES``; extend it with ``[*mine, *rules.DEFAULT_RULES]``); ``path_rules``
    name the axes of parameters that carry no logical-name metadata. Both reach everything the
    Trainer does: planning, costing, the step, the lint and the checkpoints.

    Every decision that shapes the step — mesh, microbatches, pipeline schedule and split, the
    data reduction, the weight-gather dtype, the compression — is the plan's
    (:class:`~jaxmp.plan.Layout`), built as is: ``plan`` if given (made by
    :func:`jaxmp.plan.make_plan`, as ``jaxmp train`` does), else made here by the same function
    from ``cost`` (a :class:`~jaxmp.cost.ModelCost` or a function returning one) or, for any
    model, from ``example_batch`` (global shapes: arrays or ShapeDtypeStructs); with neither,
    from the config with its defaults (an all-``auto`` mesh is plain data parallelism).
    :meth:`executed_layout` reads the layout back from what was built.
    ``extensions`` add sharded, checkpointed state beside the model's (see
    :mod:`jaxmp.train.state`). ``pipeline`` says how the model splits into stages (a
    :class:`~jaxmp.pipeline.chunk.PipelineSpec`), which ``mesh.stage > 1`` requires.
    ``compute_dtype``: the dtype the model computes in (e.g. the GPT's ``model.compute_dtype``);
    with ``compression.weights = "auto"`` fsdp gathers weights in it (docs/compression.md).
    """

    def __init__(self, config: TrainerConfig, model_fn: Callable, loss_fn: LossFn,
                 data: Iterable[dict] | None, *, rules: Sequence | None = None,
                 path_rules: Sequence | None = None, run_dir: str | os.PathLike = "runs/default",
                 eval_data: Callable[[], Iterable[dict]] | None = None,
                 model_flops_per_token: float | None = None,
                 devices: Sequence[jax.Device] | None = None, plan: Plan | None = None,
                 cost: ModelCost | Callable[[], ModelCost] | None = None,
                 example_batch: Any = None,
                 extensions: Mapping[str, Extension] | None = None,
                 pipeline: PipelineSpec | None = None, compute_dtype: str | None = None):
        self.config = config
        self.model_fn, self.loss_fn = model_fn, loss_fn
        self.data, self.eval_data = data, eval_data
        self.path_rules = path_rules
        self.run_dir = Path(run_dir)
        self.flops_per_token = model_flops_per_token
        self.example_batch = example_batch
        self.guard = guard.NonFiniteGuard(config.train.max_skipped)
        self.extensions = {**dict(extensions or {}), guard.KEY: self.guard.extension}
        self.rules = sharding.normalize_rules(sharding.DEFAULT_RULES if rules is None
                                              else rules)
        self.pipeline, self.compute_dtype = pipeline, compute_dtype
        devices = list(devices if devices is not None else jax.devices())
        abstract = sharding.abstract(lambda: model_fn(nnx.Rngs(0)))
        self.stack_blocks = stack_length(abstract, pipeline)
        self._model_remat = remat_of(abstract)  # the policy the model was built with
        self._attention = attention_of(abstract)  # and its attention kernel
        self.costs = CostSource(model_fn, loss_fn, cost, example_batch, path_rules)
        # The one plan: given (made by the same function), or made here. Everything below
        # builds its layout as is.
        self.plan = plan if plan is not None else plan_run(
            config, devices, self.costs, self.rules, pipeline is not None,
            self.stack_blocks, compute_dtype, self._model_remat,
            master.narrowest(nnx.state(abstract, nnx.Param)))
        check_plan(self.plan, len(devices), pipeline is not None, self.stack_blocks)
        planned = self.plan.layout
        try:
            self.mesh = make_mesh(planned.sizes, devices)
        except ValueError as e:  # a layout that cannot fit the devices is bad input
            raise ConfigError(f"mesh: {e}") from None
        self.accumulation = planned.accumulation
        checks.check_batch(self.mesh, self.rules, config.train.batch_size,
                           self.accumulation)  # refuse a batch the mesh cannot split
        self.extensions = {**wire.extensions(planned, path_rules), **self.extensions}
        self.gather = wire.gather(planned, self.mesh, self.rules, compute_dtype)
        self.step_rules = wire.activation_rules(planned, self.rules)  # sequence parallelism
        self.is_main = jax.process_index() == 0
        self.tx = make_optimizer(config.optimizer, config.train.steps)
        self.lr_schedule = make_schedule(config.optimizer, config.train.steps)
        self.stages = Stages.of(planned)
        transform = None if self.stages is None else \
            functools.partial(to_stages, spec=pipeline, split=self.stages.split)
        if planned.master_weights == "float32":  # the state's params: a float32 master
            transform = master.Upcast(transform)
        self.layout = plan_state(model_fn, self.tx, self.mesh, self.rules, path_rules,
                                 self.extensions, transform)
        self.compute_shardings = self.layout.shardings.params  # what the model runs with
        if planned.optimizer_sharding == "data":  # Adam state cut over data too (ZeRO-1)
            self.layout = zero.shard_state(self.layout)
            if master.built(self.layout) == "float32":  # and the master beside it
                self.layout = master.shard_params(self.layout)
            if zero.built(self.layout, self.compute_shardings) != "data":  # planned without
                raise ConfigError(f"train.optimizer_sharding='data': no parameter of this "
                                  f"model has a dim that data={planned.sizes['data']} "
                                  f"divides; set it to 'none' or 'auto'")  # costs: no cut
        self.master = master.MasterWeights.of(self.layout, self.compute_shardings) \
            if master.built(self.layout) == "float32" else None
        self.sharded_update = zero.ShardedUpdate.of(self.layout) if self.master is None and \
            zero.built(self.layout) == "data" else None
        checks.warn_idle_axes(self.layout, self.rules, path_rules, say)
        self.reducer = wire.reducer(planned, self.mesh, self.layout, path_rules,
                                    params=self.compute_shardings)
        self.executor = None if self.stages is None else PipelineExecutor(
            self.layout.graphdef, self.mesh, pipeline, self.stages.schedule, self.stages.split)
        self.grad_fn = None if self.executor is None else self.executor.grad_fn(
            without_data(self.step_rules) if self.reducer is not None else self.step_rules,
            self.gather, wide_grads=self.master is not None)
        # microbatch gradients of the layer stack summed inside the backward (jaxmp.gradsum);
        # the pipeline executor runs its own microbatches
        self.sum_in_backward = self.accumulation > 1 and self.executor is None
        self.state: TrainState | None = None
        self.history: list[dict] = []
        self._batch_spec = None

    def executed_layout(self) -> Layout:
        """The layout read back from what was built — the mesh, the pipeline executor's
        schedule, the padded stack's split, the step's accumulation, reducer and gather
        policy, the model's (or pipeline's) remat and attention kernel, the optimizer state's
        sharding, whether the step's activation rules shard the sequence — not copied from the
        plan; a test compares
        it with ``self.plan.layout`` field by field."""
        sizes = mesh_shape(self.mesh)
        st = self.stages
        if st is None:
            schedule, virtual, microbatches, split = "", 1, self.accumulation, None
            remat = self._model_remat
        else:
            s = st.schedule
            schedule, virtual, microbatches = s.kind, s.virtual, s.microbatches
            split = split_of(self.layout.abstract.params[self.pipeline.stack], s.stages,
                             s.virtual, self.stack_blocks)
            remat = self.pipeline.remat
        comp = self.reducer.comp if self.reducer is not None else Compression()
        return Layout(mesh_items(sizes), remat, microbatches, schedule, virtual, split,
                      self.reducer is not None,
                      self.gather.wire if self.gather is not None else "param", comp,
                      self._attention,
                      self.gather.reduce if self.gather is not None else "param",
                      zero.built(self.layout, self.compute_shardings),
                      sharding.shards_sequence(self.step_rules, sizes),
                      master.built(self.layout))

    # -- the one train step -------------------------------------------------------------------
    def compile(self, batch: Any = None, warmup: bool = False) -> Any:
        """The train step, lowered and compiled for this mesh (what ``fit`` runs).

        ``batch``: a global batch (arrays or ShapeDtypeStructs); default ``example_batch``.
        ``jaxmp plan --verify`` and ``jaxmp bench`` measure this same executable. ``warmup``:
        the program of PowerSGD's uncompressed first steps (``compression.powersgd_start``).
        """
        batch = self.example_batch if batch is None else batch
        if batch is None:
            raise ValueError("Trainer.compile needs a batch (or example_batch at construction)")
        reducer = wire.reducer(self.plan.layout, self.mesh, self.layout, self.path_rules,
                               warmup=True, params=self.compute_shardings) if warmup \
            else self.reducer
        step = make_train_step(self.layout, self.loss_fn, self.tx, self.lr_schedule, batch,
                               self.accumulation, self.step_rules, self.config.train.seed,
                               grad_fn=self.grad_fn, gather=self.gather, reducer=reducer,
                               guard=self.guard, zero=self.sharded_update, master=self.master,
                               sum_in_backward=self.sum_in_backward)
        with sharding.recording_names() as names:  # what the model's constraints name
            lowered = step.lower(self.layout.abstract, batch)
        if self.plan.layout.sequence_parallel:  # planned without costs: not checked before
            refuse_unnamed_sequence(names)
        return self._compile(lowered)

    def _compile(self, lowered: Any) -> Any:
        """Compile for this mesh's devices; on GPUs (attached or deviceless) with jaxmp's GPU
        flags, the plan's and the config's (:meth:`compile_options`), so ``jaxmp train`` and
        a deviceless compile of the same step get the same program."""
        if self.mesh.devices.flat[0].platform not in GPU_PLATFORMS:
            return lowered.compile()
        return compile_with_options(lowered, self.compile_options())

    def compile_options(self) -> dict[str, Any]:
        """The GPU compile options of this Trainer's step
        (:func:`jaxmp._util.env.gpu_compile_options` with the plan's ``Layout.xla_flags``)."""
        return gpu_compile_options(self.config.xla.flags, self.plan.layout.xla_flags)

    # -- set-up -------------------------------------------------------------------------------
    def lint(self) -> sharding.LintReport:
        """How the params shard on this mesh with this Trainer's rules and path rules."""
        return sharding.lint(self.layout.abstract.params, self.mesh, rules=self.rules,
                             path_rules=self.path_rules)

    def _write_run_files(self, lint: sharding.LintReport) -> None:
        if not self.is_main:
            return
        atomic_write(self.run_dir / "config.toml", config_to_toml(self.config))
        plan = {**self.plan.to_json(), "devices": self.mesh.size,
                "processes": jax.process_count(),
                "param_bytes": tree_bytes(self.layout.abstract.params),
                "state_bytes": tree_bytes(self.layout.abstract), "lint": lint.to_dict()}
        atomic_write(self.run_dir / "plan.json", json.dumps(plan, indent=2, default=str) + "\n")

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
        if self.data is None:
            raise ValueError("this Trainer was built without data; it can compile, not fit")
        if self.is_main:
            make_dir(self.run_dir, "run directory")  # a path that cannot be one: bad input
        ckpt = TrainCheckpointer(self.run_dir, cfg, self.layout, self.path_rules, self.rules,
                                 before_save=self.guard.check,  # never save a latched state
                                 from_params=functools.partial(  # an imported model's params
                                     init_state, self.layout, self.model_fn, self.tx, t.seed))
        resumed = ckpt.restore() if self.state is None else None  # newest readable checkpoint
        lint = self.lint()
        if resumed is not None:
            self.state = resumed.state
        elif self.state is None:
            self.state = init_state(self.layout, self.model_fn, self.tx, t.seed)
        start_step = int(self.state.step)
        data_iter = resume_iterator(self.data, resumed)  # continues the stream after a resume
        batch = self._next_global(data_iter)
        step_fn = self.compile(batch)  # the same executable runs the steps and reports its cost
        # written once a checkpoint that does not fit and a step that cannot be built are refused
        self._write_run_files(lint)
        warm = wire.warmup_steps(self.plan.layout)  # PowerSGD's uncompressed first steps
        warm_fn = self.compile(batch, warmup=True) if start_step < warm else None
        eval_fn = self._compile(make_eval_step(
            self.layout, self.loss_fn, batch, self.step_rules, t.seed,
            pipeline_loss=None if self.executor is None else
            self.executor.eval_fn(self.step_rules), master=self.master
        ).lower(self.layout.abstract, batch)) if self.eval_data is not None and t.eval_every > 0 \
            else None
        peers.align("compiled")  # several processes: all compiled before any program runs
        tokens = batch_tokens(batch)
        flops = self._flops_per_step(step_fn, tokens)
        peak = total_peak_flops(list(self.mesh.devices.flat))
        writer = MetricsWriter(self.run_dir, self.is_main, cfg.logging.tensorboard,
                               resume_step=start_step)  # drops lines a resume will log again
        progress = Progress(t.steps, self.is_main and cfg.logging.progress)
        if platform_note():
            progress.message(platform_note())
        kernel = f"; attention {self.plan.layout.attention}" if self.plan.layout.attention \
            else ""
        progress.message(f"jaxmp: mesh {mesh_str(dict(self.mesh.shape))} on {self.mesh.size} "
                         f"{self.mesh.devices.flat[0].platform} device(s); "
                         f"{fmt_bytes(tree_bytes(self.layout.abstract.params))} params"
                         f"{kernel}; steps {start_step}..{t.steps}; run dir {self.run_dir}")
        progress.message(f"jaxmp: params {lint.summary()}")
        wired = wire.summary(cfg, self.plan.layout, self.gather)
        if wired:
            progress.message(f"jaxmp: {wired}")
        if lint.warning():
            say(f"jaxmp: warning: {lint.warning()}")
        profile = Profiler(cfg.logging.profile_steps, self.run_dir, self.is_main)
        last_log, last_time, metrics = start_step, time.perf_counter(), {}
        preempt = Preemption().install()  # stop cleanly even with checkpoints off
        try:
            for step in range(start_step, t.steps):
                profile.maybe_start(step)
                if step > start_step:
                    batch = self._next_global(data_iter)
                run = warm_fn if step < warm else step_fn
                self.state, metrics = run(self.state, batch)
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
                              "lr": float(metrics["lr"]), **self.guard.record(metrics),
                              **memory_metrics(self.mesh.local_devices)}
                    if eval_fn is not None and (done % t.eval_every == 0 or done == t.steps):
                        record["eval_loss"] = self.evaluate(eval_fn)
                    writer.write(done, record)
                    self.history.append({"step": done, **record})
                    progress.update(done, loss, record["tokens_per_s"])
                    last_log, last_time = done, time.perf_counter()
                    self.guard.check(self.state)  # too many non-finite steps in a row: stop
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
        if self._batch_spec is None:  # resolved once: this runs every step
            self._batch_spec = batch_spec(self.mesh, self.rules, self.config.train.batch_size)
        return to_global(batch, self.mesh, self._batch_spec)
