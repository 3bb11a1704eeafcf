"""Pipeline stages balanced by FLOPs vs by layer count, measured; schedule pictures.

    python scripts/measure.py pipeline --simulate-devices 4   # docs/pipeline.md's tables, PNG
    python scripts/measure.py pipeline --simulate-devices 4 --repeats 9 --png /tmp/schedules.png

A GPT whose output head is worth several blocks (vocab 8192, d_model 128, 12 blocks) is split
into 4 stages two ways: ``pipeline.balance = "flops"`` (the cost model's per-layer FLOPs, the
head counted as a layer) and ``"layers"`` (equal numbers of table entries). Each stage's
forward and forward+backward are timed alone on one device (interleaved A B A B, median of the
repeats); the step time of each schedule is then computed from those measured stage times with
the same lockstep tick tables the executor runs (:meth:`Schedule.lockstep_time`). Finally the
same configs really run on 4 simulated CPU devices (which share this host's cores, so they
cannot show a parallel speed-up) and the schedules are drawn from their tick tables.
"""

from __future__ import annotations

import argparse
import statistics

from studies.common import devices, times

DOC = "docs/pipeline.md"
DEVICES = True
STAGES, MICRO = 4, 8
SETS = ["model.layers=12", "model.d_model=128", "model.heads=4", "model.vocab_size=8192",
        "data.seq_len=128", "train.batch_size=32", "data.source=synthetic",
        "checkpoint.enabled=false", "logging.progress=false", "logging.tensorboard=false",
        "train.eval_every=0", "mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1"]


def stage_fns(config, split):
    """For each chunk of ``split``: jitted ``fwd(params, x_or_tokens, targets)`` and ``fwd+bwd``,
    running the chunk's slice of the GPT alone on one device, and their example inputs."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxmp.models import next_token_loss
    from jaxmp.recipes.gpt import gpt_model_fn

    model = gpt_model_fn(config)(nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    block_def, _ = nnx.split(model.blocks)
    rows = config.train.batch_size // MICRO
    tokens = jnp.zeros((rows, config.data.seq_len), jnp.int32)
    out = []
    for c in range(split.chunks):
        blocks = list(split.blocks_of(c))
        first, last = c == 0, c == split.chunks - 1

        def forward(p, x, targets, blocks=blocks, first=first, last=last):
            m = nnx.merge(graphdef, p)
            h = m.embed_tokens(x) if first else x
            stacked = nnx.state(m.blocks)
            for i in blocks:
                h = nnx.merge(block_def, jax.tree.map(lambda a, i=i: a[i], stacked))(h)
            if last:
                return next_token_loss(m.logits(h), {"targets": targets})[0]
            return jnp.sum(h)

        grad = jax.grad(forward, argnums=(0, 1) if not first else 0)
        x = tokens if first else jnp.zeros((rows, config.data.seq_len, config.model.d_model))
        out.append((jax.jit(forward), jax.jit(grad), (params, x, tokens)))
    return out


def measure_splits(config, splits, repeats: int) -> dict:
    """Median forward and backward seconds per chunk, splits measured interleaved."""
    fns = {name: stage_fns(config, s) for name, s in splits.items()}
    samples = {name: [([], []) for _ in s] for name, s in fns.items()}
    for _ in range(repeats):  # A B A B: load changes hit every split alike
        for name, chunk_fns in fns.items():
            for c, (fwd, fb, args) in enumerate(chunk_fns):
                samples[name][c][0].extend(times(fwd, args, 1))
                samples[name][c][1].extend(times(fb, args, 1))
    out = {}
    for name, per in samples.items():
        f = [statistics.median(a) for a, _ in per]
        fb = [statistics.median(b) for _, b in per]
        out[name] = (f, [max(0.0, y - x) for x, y in zip(f, fb)],
                     [max(b) / min(b) - 1 for _, b in per])
    return out


def run_on_cpu(schedule: str, extra: list[str], steps: int, devs: list) -> float:
    """Median step time of the real pipelined Trainer on the first STAGES devices."""
    import jaxmp
    from jaxmp.recipes.gpt import gpt_trainer

    config = jaxmp.load_config(None, SETS + [f"mesh.stage={STAGES}", f"train.steps={steps}",
                                             f"pipeline.schedule={schedule}",
                                             "logging.every=1", *extra])
    trainer = gpt_trainer(config, "/tmp/jaxmp-bench-pipeline", devices=devs[:STAGES])
    trainer.fit()
    return statistics.median(h["step_time_s"] for h in trainer.history[2:])


def draw(schedules, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(schedules), 1, figsize=(12, 2.2 * len(schedules)))
    cmap = plt.get_cmap("tab10")
    for ax, (title, s) in zip(axes, schedules):
        for t, row in enumerate(s.events):
            for d, (f, b) in enumerate(row):
                for k, act in enumerate((f, b)):
                    if act is None:
                        continue
                    mb, c = act
                    ax.add_patch(plt.Rectangle((t, d + 0.5 * k), 1, 0.5, color=cmap(mb % 10),
                                               alpha=1.0 if k == 0 else 0.55, lw=0))
                    ax.text(t + 0.5, d + 0.25 + 0.5 * k, f"{'FB'[k]}{mb}" + (
                        f".{c // s.stages}" if s.virtual > 1 else ""), ha="center",
                            va="center", fontsize=6)
        ax.set_xlim(0, len(s.events))
        ax.set_ylim(s.stages, 0)
        ax.set_yticks([d + 0.5 for d in range(s.stages)], labels=[str(d) for d in
                                                                  range(s.stages)])
        ax.set_ylabel("device")
        ax.set_title(f"{title}: {len(s.events)} ticks, bubble {s.bubble_fraction:.0%}, "
                     f"in flight on device 0: {s.in_flight(0)}", fontsize=9)
    axes[-1].set_xlabel("tick (upper half: forward F<microbatch>, lower half: backward B)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--steps", type=int, default=6, help="steps of each real 4-device run")
    p.add_argument("--png", default="docs/pipeline_schedules.png")


def run(args: argparse.Namespace) -> int:
    devs = devices(args, at_least=STAGES)
    import jaxmp
    from jaxmp.pipeline.footprint import fold, stack_span
    from jaxmp.pipeline.schedule import Schedule
    from jaxmp.pipeline.stages import split_layers
    from jaxmp.recipes.gpt import gpt_costs

    config = jaxmp.load_config(None, SETS)
    layers = gpt_costs(config, ("none",)).layers  # folded as the planner folds them
    table = fold([lay.flops("none") for lay in layers],
                 stack_span([lay.kind for lay in layers],
                            [lay.group or lay.name for lay in layers]))
    splits = {"flops": split_layers(table, STAGES, 1, "flops"),
              "layers": split_layers(table, STAGES, 1, "layers"),
              "flops, V=2": split_layers(table, STAGES, 2, "flops")}
    print(f"per-layer training FLOPs (pre, {len(table) - 2} blocks, post): "
          f"{', '.join(f'{x / 1e9:.2f}G' for x in table)}\n")
    measured = measure_splits(config, splits, args.repeats)
    print("| split | blocks per chunk | stage forward+backward ms (measured alone) | "
          "max / mean | spread of samples |\n|---|---|---|---:|---:|")
    for name, (f, b, spread) in measured.items():
        fb = [x + y for x, y in zip(f, b)]
        per_device = [sum(fb[c] for c in range(d, len(fb), STAGES)) for d in range(STAGES)]
        print(f"| {name} | {splits[name].per_chunk} | "
              f"{', '.join(f'{x * 1e3:.1f}' for x in fb)} | "
              f"{max(per_device) / statistics.mean(per_device):.2f} | "
              f"≤ {max(spread):.0%} |")
    print("\n| schedule | split | step ms (from measured stage times) | bubble share | "
          "formula | vs layers split |\n|---|---|---:|---:|---:|---:|")
    steps = {}
    for kind, name, v in (("gpipe", "layers", 1), ("gpipe", "flops", 1), ("1f1b", "layers", 1),
                          ("1f1b", "flops", 1), ("interleaved", "flops, V=2", 2)):
        s = Schedule(kind, STAGES, MICRO, v)
        f, b, _ = measured[name]
        step = s.lockstep_time(f, b)
        busy = MICRO * sum(x + y for x, y in zip(f, b)) / STAGES
        steps[(kind, name)] = step
        ref = steps.get(("1f1b" if kind == "interleaved" else kind, "layers"), step)
        print(f"| {kind} | {name} | {step * 1e3:.1f} | {1 - busy / step:.1%} | "
              f"{s.bubble_fraction:.1%} | {ref / step:.2f}x |")
    print("\n| schedule (4 simulated CPU devices, flops split) | median step s |\n|---|---:|")
    for kind, extra in (("gpipe", []), ("1f1b", []),
                        ("interleaved", ["pipeline.virtual_stages=2"])):
        print(f"| {kind} | {run_on_cpu(kind, extra, args.steps, devs):.3f} |", flush=True)
    draw([(f"GPipe, P={STAGES}, M={MICRO}", Schedule("gpipe", STAGES, MICRO)),
          (f"1F1B, P={STAGES}, M={MICRO}", Schedule("1f1b", STAGES, MICRO)),
          (f"interleaved 1F1B, P={STAGES}, M={MICRO}, V=2",
           Schedule("interleaved", STAGES, MICRO, 2))], args.png)
    print(f"\nwrote {args.png}")
    return 0

