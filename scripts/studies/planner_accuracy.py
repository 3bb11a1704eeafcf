"""The planner's predictions against Megatron's formula, XLA and the compiled step.

    python scripts/measure.py planner-accuracy --simulate-devices 8 [--set KEY=VALUE ...]
        [--meshes dp,fsdp,tensor,data=2,fsdp=2,tensor=2] [--megatron-configs] [--skip-layers]

Regenerates the accuracy tables of docs/planner.md:

1. training FLOPs of the cost model vs Megatron's 72·B·s·l·h²·(1 + s/6h) + 6·B·s·h·V;
2. each distinct layer's forward (and forward + backward) FLOPs vs XLA's ``cost_analysis`` of
   the layer compiled alone;
3. on the devices (the doc: 8 simulated CPU devices), predicted vs compiled per-device
   argument bytes, peak bytes (argument + temp) and collective bytes for data, fsdp, tensor
   and a hybrid mesh, and with ``--meshes stage=2,data=4,stage=2,fsdp=2,tensor=2,stage=4,data=2``
   for pipeline stages (the plan's schedule and microbatches). ``--meshes`` names meshes as
   ``jaxmp bench --strategies`` does.
"""

from __future__ import annotations

import argparse

from studies.common import devices, mesh_sets, meshes

DOC = "docs/planner.md"
DEVICES = True


def megatron_flops(config) -> tuple[float, float]:
    """(Megatron's formula, our cost model) training FLOPs per step for a GPT config."""
    from jaxmp.recipes.gpt import gpt_costs, resolve_data

    config = resolve_data(config)  # model.vocab_size 0 means "from the data"
    m = config.model
    b, s, h, n, v = (config.train.batch_size, config.data.seq_len, m.d_model, m.layers,
                     m.vocab_size)
    ref = 72 * b * s * n * h * h * (1 + s / (6 * h)) + 6 * b * s * h * v
    return ref, gpt_costs(config, ("none",)).flops_per_step("none")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--meshes", default="dp,fsdp,tensor,data=2,fsdp=2,tensor=2",
                   help="meshes as `jaxmp bench --strategies` names them (default %(default)s)")
    p.add_argument("--skip-layers", action="store_true", help="skip the XLA layer compiles")
    p.add_argument("--megatron-configs", action="store_true",
                   help="also compare FLOPs for the bundled configs and a 175B shape")


def run(args: argparse.Namespace) -> int:
    from jaxmp.cost import xla_layer_check
    from jaxmp.recipes.gpt import gpt_costs, gpt_plan, gpt_trainer
    from jaxmp.recipes.gpt_config import CONFIG_DIR, load_config
    from jaxmp.tools.verify import verify_prediction

    devs = devices(args)
    base = load_config(None, args.set)
    label = " ".join(args.set) or "configs/tiny.toml"
    print(f"## {label}\n")
    print("| model (Megatron's shape: GELU 4h MLP) | Megatron FLOPs/step | cost model | "
          "rel. err |\n|---|---|---|---|")
    # Megatron's formula assumes a GELU MLP of 4h and full multi-head attention.
    megatron_shape = ["model.mlp_dim=0", "model.activation=gelu", "model.kv_heads=0",
                      "model.head_dim=0"]
    shapes = {label: (None, args.set)}
    if args.megatron_configs:
        shapes.update({
            "gpt2-small.toml": ("gpt2-small.toml", []),
            "gpt-1b.toml": ("gpt-1b.toml", []),
            "GPT-3 175B (96 x 12288, s 2048, B 8)": (None, [
                "model.layers=96", "model.d_model=12288", "model.heads=96",
                "model.vocab_size=50304", "data.seq_len=2048", "train.batch_size=8",
                "data.source=synthetic"])})
    for name, (path, sets) in shapes.items():
        path = CONFIG_DIR / path if path else None
        ref, ours = megatron_flops(load_config(path, sets + megatron_shape))
        print(f"| {name} | {ref:.4g} | {ours:.4g} | {abs(ours - ref) / ref:.2%} |")
    print()
    if not args.skip_layers:
        print("| layer | pass | cost model | XLA alone | rel. err |\n|---|---|---|---|---|")
        for r in xla_layer_check(gpt_costs(base, ("none",))):
            print(f"| {r['layer']} | {r['pass']} | {r['predicted']:.4g} | {r['xla']:.4g} | "
                  f"{r['rel_err']:.2%} |")
        print()
    print("| mesh | argument bytes (pred / compiled / err) | peak bytes | collective bytes |\n"
          "|---|---|---|---|")
    for name, axes in meshes(args.meshes, len(devs)):
        config = load_config(None, args.set + mesh_sets(axes))
        plan = gpt_plan(config, len(devs), "CPU", strict=True)
        v = verify_prediction(
            lambda d, c=config, p=plan: gpt_trainer(c, devices=d, with_data=False, plan=p),
            plan, devs)
        cells = [f"{v[k]['predicted'] / 2**20:.2f} / {v[k]['compiled'] / 2**20:.2f} MiB / "
                 f"{v[k]['rel_err']:.1%}" for k in ("argument_bytes", "peak_bytes",
                                                    "comm_bytes_per_step")]
        if plan.schedule:  # a pipeline: which schedule the plan (and the compiled step) ran
            name += f" ({plan.schedule}{f' x{plan.virtual}' if plan.virtual > 1 else ''}, " \
                    f"{plan.microbatches} mb)"
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
    return 0

