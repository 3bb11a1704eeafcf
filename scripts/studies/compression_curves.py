"""Does compressing the gradient reduction hurt training? The default run, seven ways.

    python scripts/measure.py compression-curves --simulate-devices 4   # 7 runs x 300 steps
    python scripts/measure.py compression-curves --simulate-devices 4 --plot-only  # redraw

Each run is ``jaxmp train`` with the defaults (configs/tiny.toml: the byte-level GPT on the
stdlib corpus, batch 16 x 128) on the simulated CPU devices, all on the data axis, for
``--steps`` steps, evaluated every 50: uncompressed, bf16, int8 with and without error
feedback, PowerSGD rank 4 and 16, and rank 4 after 100 uncompressed steps. Bytes per step
come from each run's compiled step (``jaxmp.hlo.collective_stats``), and the step time a
slow link would add is those bytes over the inter-host bandwidth of a device profile (A100:
25 GB/s). Writes the PNG and a JSON summary and prints the Markdown table of
docs/compression.md. Needs matplotlib (``pip install -e ".[report]"``).
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

from jaxmp.errors import UsageError

DOC = "docs/compression.md"
DEVICES = True

VARIANTS = [
    ("none", []),
    ("bf16", ["compression.gradients=bfloat16"]),
    ("int8 + error feedback", ["compression.gradients=int8"]),
    ("int8, no error feedback", ["compression.gradients=int8", "compression.error_feedback=false"]),
    ("PowerSGD rank 4", ["compression.gradients=powersgd", "compression.powersgd_rank=4"]),
    ("PowerSGD rank 16", ["compression.gradients=powersgd", "compression.powersgd_rank=16"]),
    ("PowerSGD rank 4, 100 warm-up steps", ["compression.gradients=powersgd",
                                            "compression.powersgd_rank=4",
                                            "compression.powersgd_start=100"]),
]
PROFILE = "A100-80GB"  # its inter-host link: 25 GB/s per device


def common(args: argparse.Namespace) -> list[str]:
    return [f"mesh.data={args.n}", f"train.steps={args.steps}", "train.eval_every=50",
            "logging.every=10", "checkpoint.enabled=false", "logging.tensorboard=false",
            *args.set]


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")


def train(args: argparse.Namespace, name: str, sets: list[str]) -> None:
    run = args.runs / slug(name)
    shutil.rmtree(run, ignore_errors=True)
    cmd = [sys.executable, "-m", "jaxmp.cli", "train", "--simulate-devices", str(args.n),
           "--run-dir", str(run)]
    for s in common(args) + sets:
        cmd += ["--set", s]
    print("$", " ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, check=True)


def step_bytes(args: argparse.Namespace) -> dict[str, float]:
    """Bytes each device sends per step, from the compiled step of each variant."""
    import jax

    import jaxmp
    from jaxmp.recipes.gpt import gpt_trainer
    from jaxmp.tools.measure import measure_step

    devices = jax.devices()[:args.n]
    out = {}
    for name, sets in VARIANTS:
        config = jaxmp.load_config(None, common(args) + sets)
        trainer = gpt_trainer(config, "unused", devices=devices, with_data=False)
        out[name] = measure_step(trainer).collectives.total_bytes
    return out


def curves(args: argparse.Namespace, name: str) -> dict[str, list]:
    rows = [json.loads(line) for line in
            (args.runs / slug(name) / "metrics.jsonl").read_text().splitlines()]
    return {"step": [r["step"] for r in rows], "loss": [r["loss"] for r in rows],
            "eval_step": [r["step"] for r in rows if "eval_loss" in r],
            "eval_loss": [r["eval_loss"] for r in rows if "eval_loss" in r]}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--runs", type=Path, default=Path("runs/compression"))
    p.add_argument("--out", type=Path, default=Path("docs/compression_curves.png"))
    p.add_argument("--plot-only", action="store_true", help="redraw from the run directories")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="more overrides for every run (the doc's runs: none)")


def run(args: argparse.Namespace) -> int:
    if args.simulate_devices is None:
        raise UsageError("compression-curves trains on simulated CPU devices: give "
                         "--simulate-devices N (the doc's runs: 4)")
    args.n = args.devices or args.simulate_devices
    try:
        import matplotlib
    except ImportError:
        raise UsageError("compression-curves needs matplotlib: pip install -e '.[report]'")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not args.plot_only:
        for name, sets in VARIANTS:
            train(args, name, sets)
    sent = step_bytes(args)
    from jaxmp.devices import PROFILES

    link = PROFILES[PROFILE].inter_host_bw
    data = {name: curves(args, name) for name, _ in VARIANTS}
    ref = data["none"]["eval_loss"][-1]
    summary = {name: {"bytes_per_step": sent[name], "slow_link_ms": 1e3 * sent[name] / link,
                      "final_loss": d["loss"][-1], "final_eval_loss": d["eval_loss"][-1],
                      "eval_vs_none": d["eval_loss"][-1] / ref - 1} for name, d in data.items()}
    args.out.with_suffix(".json").write_text(json.dumps(summary, indent=2) + "\n")

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    for name, d in data.items():
        s = summary[name]
        label = (f"{name}: {s['bytes_per_step'] / 1e6:.2f} MB/step, "
                 f"{s['slow_link_ms']:.2f} ms at 25 GB/s")
        left.plot(d["step"], d["loss"], label=label)
        right.plot(d["eval_step"], d["eval_loss"], marker="o", label=name)
    left.set(xlabel="step", ylabel="train loss (nats/byte)", yscale="log",
             title=f"jaxmp train defaults, data={args.n}, bytes each device sends")
    right.set(xlabel="step", ylabel="eval loss (nats/byte)", title="held-out loss")
    left.legend(fontsize=8)
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)

    print(f"| compression | bytes / device / step | vs none | at 25 GB/s | final train loss "
          f"| final eval loss | eval vs none |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, s in summary.items():
        print(f"| {name} | {s['bytes_per_step']:,.0f} | "
              f"{s['bytes_per_step'] / summary['none']['bytes_per_step']:.3f} | "
              f"{s['slow_link_ms']:.2f} ms | {s['final_loss']:.4f} | {s['final_eval_loss']:.4f} "
              f"| {100 * s['eval_vs_none']:+.2f} % |")
    return 0
