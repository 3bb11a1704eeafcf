"""Memory of the GPT train step with XLA's and cuDNN's attention, compiled for absent GPUs.

The step is compiled for H100s that are not attached (XLA's GPU compiler on this CPU machine);
the planner's prediction is printed beside each compiled number.

    python scripts/measure.py deviceless-attention [--devices 8] [--kind H100]
        [--seqs 2048 8192] [--set KEY=VALUE ...]

Needs JAX's CUDA plugin (``pip install -e ".[cuda]"``); nothing runs, so no GPU is needed.
Prints a markdown table: compile time, the compiled program's temporaries and peak
(arguments + temporaries) per device, the planner's predicted peak for the same layout, the
collective bytes per device per step, and the async collectives with a matmul scheduled
between start and done (overlapped) out of all (``jaxmp.hlo.collective_overlap``), with the
fsdp all-gathers of the layer loop apart.
"""

from __future__ import annotations

import argparse
import os
import time

DOC = "docs/benchmarks.md"
DEVICES = False  # GPUs that are not attached: --devices is how many the program is compiled for

# A GPT block stack at long sequences: attention is most of the activations.
DEFAULT = ["model.layers=4", "model.d_model=512", "model.heads=8", "model.vocab_size=256",
           "model.compute_dtype=bfloat16", "data.source=synthetic"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--devices", type=int, default=8, metavar="N",
                   help="the number of GPUs to compile for (default %(default)s)")
    p.add_argument("--kind", default="H100", help="their device profile (default %(default)s)")
    p.add_argument("--seqs", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")


def run(args: argparse.Namespace) -> int:
    os.environ["JAX_PLATFORMS"] = "cpu"  # the plugin must not look for a driver

    from jaxmp.hlo import collective_overlap
    from jaxmp.recipes.gpt import gpt_plan, gpt_trainer
    from jaxmp.recipes.gpt_config import load_config
    from jaxmp.tools.measure import measure_step
    from jaxmp.topology import gpu_topology, without_persistent_cache

    without_persistent_cache()
    n = args.devices
    topo = gpu_topology(n, args.kind)
    gib = 2**30
    print(f"{topo}; fsdp {n}, batch {n} sequences, {' '.join(DEFAULT + args.set)}\n")
    print("| seq | attention | compile s | temp GiB | peak GiB | predicted peak GiB | "
          "collectives MiB | overlapped / async | loop all-gathers exposed |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for seq in args.seqs:
        for attention in ("xla", "cudnn"):
            config = load_config(None, [*DEFAULT, f"data.seq_len={seq}",
                                        f"train.batch_size={n}", f"model.attention={attention}",
                                        "mesh.data=1", "mesh.stage=1", f"mesh.fsdp={n}",
                                        "mesh.tensor=1", *args.set])
            plan = gpt_plan(config, n, device_kind=args.kind, platform="cuda")
            trainer = gpt_trainer(config, devices=list(topo.devices), with_data=False, plan=plan)
            start = time.perf_counter()
            m = measure_step(trainer)
            seconds = time.perf_counter() - start
            ov = collective_overlap(m.compiled)
            rows = ov.by_kind().values()
            print(f"| {seq} | {attention} | {seconds:.1f} | {m.temp_bytes / gib:.2f} | "
                  f"{m.peak_bytes / gib:.2f} | {plan.predicted.per_device_bytes / gib:.2f} | "
                  f"{m.collectives.total_bytes / 2**20:.1f} | "
                  f"{sum(r['overlapped'] for r in rows)} / {sum(r['async'] for r in rows)} | "
                  f"{ov.exposed_loop_all_gathers} of {len(ov.loop_all_gathers)} |", flush=True)
    return 0

