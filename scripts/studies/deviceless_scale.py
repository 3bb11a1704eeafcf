"""The planner judged by XLA's GPU compiler at scale, without a GPU (docs/planner.md §7).

    python scripts/measure.py deviceless-scale [--cases 8b 70b 70b-stages pipe]
        [--set KEY=VALUE ...]

Each case is one ``jaxmp plan --verify --aot --json`` command, run in its own process and
printed before it runs: the planner chooses the layout (or the case fixes the mesh), the
Trainer builds the step ``jaxmp train`` would run on that many deviceless H100s, XLA's GPU
compiler compiles it here, and the plan's predictions stand beside the compiled program's
figures. Prints a markdown table: the layout, compile time, predicted / compiled peak per
device, predicted / compiled collective bytes per device per step, the planner's fits verdict
and the compiled peak's (what the GPU runtime allocates), XLA's rematerialization estimate
when it warned (information: docs/planner.md §7), and the fsdp all-gathers of the layer loop
left exposed. Needs JAX's CUDA plugin (``pip install -e
".[cuda]"``); nothing runs, so no GPU is needed.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time

DOC = "docs/planner.md"  # and docs/benchmarks.md's compile times of the scale cases
DEVICES = False  # each case's command compiles for its own count of deviceless H100s

GPT = ["model.activation=swiglu", "model.tie_embeddings=false", "model.vocab_size=128256",
       "model.compute_dtype=bfloat16", "model.remat=auto", "data.source=synthetic"]
# Llama-3-70B's shape, batch 64 x 8192.
LLAMA_70B = [*GPT, "model.layers=80", "model.d_model=8192", "model.heads=64", "model.kv_heads=8",
             "model.mlp_dim=28672", "data.seq_len=8192", "train.batch_size=64"]
CASES = {
    # Llama-3-8B's shape, batch 8 x 8192 on one host of 8 H100s, fsdp 8.
    "8b": (8, [*GPT, "model.layers=32", "model.d_model=4096", "model.heads=32",
               "model.kv_heads=8", "model.mlp_dim=14336", "data.seq_len=8192",
               "train.batch_size=8", "mesh.data=1", "mesh.stage=1", "mesh.fsdp=8",
               "mesh.tensor=1"]),
    # Llama-3-70B's shape, batch 64 x 8192 on 8 hosts of 8 H100s, the planner's layout.
    "70b": (64, LLAMA_70B),
    # The layout of the 70B case: stage 4 x fsdp 2 x tensor 8.
    "70b-stages": (64, [*LLAMA_70B, "mesh.data=1", "mesh.stage=4", "mesh.fsdp=2",
                        "mesh.tensor=8"]),
    # A 34B (CodeLlama-34B's shape) pipelined stage 2 x tensor 8 x data 2 on 4 hosts of 8.
    "pipe": (32, [*GPT, "model.layers=48", "model.d_model=8192", "model.heads=64",
                  "model.kv_heads=8", "model.mlp_dim=22016", "data.seq_len=4096",
                  "train.batch_size=64", "mesh.data=2", "mesh.stage=2", "mesh.fsdp=1",
                  "mesh.tensor=8"]),
}
GIB = 2**30


def command(n: int, sets: list[str]) -> list[str]:
    return [sys.executable, "-m", "jaxmp.cli", "plan", "--devices", str(n), "--device-kind",
            "H100", "--verify", "--aot", "--json", *[a for s in sets for a in ("--set", s)]]


def row(name: str, out: dict, wall: float) -> str:
    v, layout = out["verify"], out["layout"]
    mesh = " x ".join(f"{k} {s}" for k, s in layout["mesh"].items() if s > 1)
    peak, comm = v["peak_bytes"], v["comm_bytes_per_step"]
    short = v.get("xla_rematerialization")
    remat = (f"{short['needed_bytes'] / GIB:.1f} of {short['limit_bytes'] / GIB:.1f}"
             if short else "–")
    coll = v["collectives"]
    signed = lambda r: (r["predicted"] - r["compiled"]) / r["compiled"]  # noqa: E731
    return (f"| {name} | {mesh}, remat {layout['remat']}, attention {layout['attention']} | "
            f"{v['compile_s']:.0f} s ({wall:.0f} s) | "
            f"{peak['predicted'] / GIB:.1f} / {peak['compiled'] / GIB:.1f} "
            f"({signed(peak):+.1%}) | {comm['predicted'] / GIB:,.1f} / "
            f"{comm['compiled'] / GIB:,.1f} ({signed(comm):+.1%}) | "
            f"{'yes' if v['predicted_fits'] else 'no'} / {'yes' if v['fits'] else 'no'} | "
            f"{remat} | {coll['loop_all_gathers_exposed']} of {coll['loop_all_gathers']} |")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")


def run(args: argparse.Namespace) -> int:
    rows = []
    for name in args.cases:
        n, sets = CASES[name]
        cmd = command(n, [*sets, *args.set])
        print("$ " + shlex.join(["python", *cmd[1:]]), flush=True)
        start = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if done.returncode:
            print(done.stderr[-3000:], file=sys.stderr)
            rows.append(f"| {name} | failed (exit {done.returncode}) | | | | | | |")
            continue
        rows.append(row(name, json.loads(done.stdout), wall))
    print("\n| case | layout | compile (command) | peak GiB: predicted / compiled | "
          "collective GiB: predicted / compiled | fits: planner / compiled peak | "
          "XLA remat estimate: GiB of its limit | loop all-gathers exposed |")
    print("|---|---|---:|---:|---:|---|---:|---:|")
    print("\n".join(rows))
    return 0
