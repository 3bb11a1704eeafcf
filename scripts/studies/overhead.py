"""Overhead of the `jaxmp train` loop against a minimal hand-written jax + optax loop.

    python scripts/measure.py overhead                    # tiny config, 1 CPU device
    python scripts/measure.py overhead --pairs 7 --steps 160 --set model.d_model=64

A (the Trainer, exactly as `jaxmp train` builds it: ``gpt_trainer(config).fit()``) and B (a
hand-written loop: the same GPT, loss, optax AdamW + clipping, mesh and parameter shardings,
the same batches, ``float(loss)`` every ``--every`` steps) run interleaved in one process,
after one unrecorded warm-up pair. Both read their batches through a wrapper that
stamps the time of every ``next()``; a loop's time per step is the span between the batch
requests right after its logging points ``every`` and ``steps - every`` (both loops block on
the loss there, so both ends are drained) divided by the steps in between: compiling, set-up
and shutdown are outside it, every per-step cost of the loop is inside. Checkpoints and eval
are off in A (B has neither); metrics.jsonl, TensorBoard and the progress lines stay on.

Pairs alternate their order (A B, then B A) so that an order effect cancels. Prints each pair's
A/B ratio on three clocks (wall; process CPU, steadier on a shared machine; main-thread CPU, the
loop's own host work), then the median and the spread, and checks both loops reach the same
loss (they compute the same thing).
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from jaxmp.errors import UsageError
from studies.common import devices

DOC = "docs/benchmarks.md"
DEVICES = True

CLOCKS = ("wall", "cpu", "host")


class Stamped:
    """An iterator that records when each batch was asked for, on three clocks: the wall clock,
    the process's CPU time (all threads: less disturbed by other jobs sharing the cores), and
    the main thread's CPU time (the loop's own host work: dispatch, batches, logging; XLA
    computes on its own threads)."""

    def __init__(self, data):
        self.it = iter(data)
        self.times: list[tuple[float, float]] = []

    def __iter__(self):
        return self

    def __next__(self):
        self.times.append((time.perf_counter(), time.process_time(), time.thread_time()))
        return next(self.it)


def per_step(times: list[tuple[float, ...]], steps: int, every: int) -> tuple[float, ...]:
    """Seconds per step on each clock between the batch requests after two logging points."""
    first, last = times[every], times[steps - every]
    return tuple((b - a) / (steps - 2 * every) for a, b in zip(first, last))


def run_trainer(config, run_dir: str, steps: int, every: int, devs: list) -> tuple[tuple, float]:
    from jaxmp.recipes.gpt import gpt_trainer

    trainer = gpt_trainer(config, run_dir, devices=devs)
    trainer.data = stamped = Stamped(trainer.data)
    final = trainer.fit()
    return per_step(stamped.times, steps, every), final["loss"]


def run_hand(config, mesh_shape: dict, steps: int, every: int, devs: list) -> tuple[tuple, float]:
    """The loop a person would write with jax, optax and the same model and shardings."""
    import jax
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    import jaxmp
    from jaxmp import rules
    from jaxmp.models import lm_loss
    from jaxmp.recipes.gpt import gpt_model_fn, lm_batches

    o = config.optimizer
    mesh = jaxmp.make_mesh(mesh_shape, devs)
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, o.lr, min(o.warmup_steps, steps - 1), steps, o.lr * o.min_lr_ratio)
    tx = optax.chain(optax.clip_by_global_norm(o.clip_norm),
                     optax.adamw(schedule, b1=o.beta1, b2=o.beta2, eps=o.eps,
                                 weight_decay=o.weight_decay,
                                 mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)))
    graphdef, params, rest = nnx.split(gpt_model_fn(config)(nnx.Rngs(config.train.seed)),
                                       nnx.Param, ...)
    p_sh = rules.shardings_for(params, mesh)
    params = jax.device_put(params, p_sh)
    o_sh = rules.shardings_for(jax.eval_shape(tx.init, params), mesh)
    opt_state = jax.jit(tx.init, out_shardings=o_sh)(params)
    batch_sh = NamedSharding(mesh, PartitionSpec(("data", "fsdp")))

    def loss_fn(p, batch):
        with rules.activation_sharding(mesh):
            return lm_loss(nnx.merge(graphdef, p, rest), batch)[0]

    def train_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    step_fn = jax.jit(train_step, donate_argnums=(0, 1),
                      out_shardings=(p_sh, o_sh, NamedSharding(mesh, PartitionSpec())))
    data = Stamped(lm_batches(config))
    loss = float("nan")
    for step in range(steps):
        batch = jax.device_put(next(data), batch_sh)
        params, opt_state, loss_arr = step_fn(params, opt_state, batch)
        if (step + 1) % every == 0:
            loss = float(loss_arr)
    return per_step(data.times, steps, every), loss


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--every", type=int, default=10, help="logging.every (both loops)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")


def run(args: argparse.Namespace) -> int:
    if args.steps < 3 * args.every:
        raise UsageError("--steps must be at least 3 x --every")
    devs = devices(args)
    from jaxmp.recipes.gpt import gpt_trainer
    from jaxmp.recipes.gpt_config import load_config

    config = load_config(None, [f"train.steps={args.steps}", f"logging.every={args.every}",
                                "checkpoint.enabled=false", "train.eval_every=0", *args.set])
    mesh_shape = dict(gpt_trainer(config, with_data=False, devices=devs).mesh.shape)  # planned
    print(f"# {args.pairs} pairs of {args.steps} steps, mesh {mesh_shape}, "
          f"overrides {args.set or 'none'}; seconds per step over steps "
          f"[{args.every}, {args.steps - args.every})", flush=True)
    ratios: dict[str, list[float]] = {c: [] for c in CLOCKS}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.pairs + 1):
            # A B, then B A: an order effect (a warmer cache, a job starting) cancels out
            order = ("a", "b") if i % 2 == 0 else ("b", "a")
            got = {}
            for which in order:
                got[which] = run_trainer(config, f"{tmp}/a{i}", args.steps, args.every, devs) \
                    if which == "a" else run_hand(config, mesh_shape, args.steps, args.every, devs)
            (a, loss_a), (b, loss_b) = got["a"], got["b"]
            same = abs(loss_a - loss_b) < 1e-3 * max(1.0, abs(loss_b))
            tag = "warm-up" if i == 0 else f"pair {i}"
            print(f"{tag:>8} ({''.join(order).upper()}): " + " | ".join(
                f"{c} {x * 1e3:8.3f} / {y * 1e3:8.3f} ms = {x / y:.3f}"
                for c, x, y in zip(CLOCKS, a, b))
                + f" | loss {loss_a:.4f} / {loss_b:.4f}{'' if same else ' (DIFFERENT)'}",
                flush=True)
            if i:
                for c, x, y in zip(CLOCKS, a, b):
                    ratios[c].append(x / y)
    for c, rs in ratios.items():
        print(f"{c:>4} time per step, trainer / hand: median {statistics.median(rs):.4f}, "
              f"min {min(rs):.4f}, max {max(rs):.4f} (pairs: {' / '.join(f'{r:.3f}' for r in rs)})")
    return 0

