"""``jaxmp bench [CONFIG] [--devices N] [--simulate-devices N] [--strategies a,b,...]
[--steps K] [--json] [--out DIR] [--aot --device-kind KIND]``.

``--devices N`` runs on the first N devices present (fewer is bad input);
``--simulate-devices N`` gives the CPU backend N devices before jax starts and runs on them;
``--aot`` compiles each strategy for N deviceless GPUs of ``--device-kind`` with XLA's GPU
compiler instead (JAX on the CPU, JAX's CUDA plugin required), without running it: memory
and bytes are the GPU program's, the step time only the planner's.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from jaxmp.cli.plan import aot_topology
from jaxmp.cli.train import add_config_arguments, add_device_arguments
from jaxmp.errors import UsageError


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    from jaxmp.tools.strategies import DEFAULT

    p = subparsers.add_parser(
        "bench", help="measure parallelism strategies side by side against the planner",
        description="Compile and time the configured model's train step under each strategy "
                    "(the same Trainer step as `jaxmp train`, the same model and global batch): "
                    "per-device memory, collective bytes by kind, step time, tokens/s, MFU, "
                    "each beside the planner's prediction.")
    add_config_arguments(p)
    add_device_arguments(p, "to run on: the first N present")
    p.add_argument("--strategies", default=DEFAULT, metavar="LIST",
                   help="comma-separated: dp, fsdp, tensor, fsdp+tensor, stage, auto, or "
                        "explicit sizes like data=2,fsdp=4 (default: %(default)s)")
    p.add_argument("--steps", type=int, default=10, metavar="K",
                   help="timed steps per strategy; the median is reported (default %(default)s)")
    p.add_argument("--warmup", type=int, default=2, metavar="W",
                   help="untimed steps first (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print bench.json instead of the table")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="write bench.md, bench.json and PNG charts there")
    p.add_argument("--device-kind", default=None, metavar="KIND",
                   help="device profile for the planner, e.g. H100 (default: detected)")
    p.add_argument("--aot", action="store_true",
                   help="compile each strategy for --devices N deviceless GPUs of --device-kind "
                        "with XLA's GPU compiler, here, without running it (needs JAX's CUDA "
                        'plugin: pip install -e ".[cuda]")')
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from jaxmp._util.env import add_xla_flags
    from jaxmp.cli.train import apply_precision, device_count, present_devices, simulate
    from jaxmp.recipes.gpt_config import load_config
    from jaxmp.tools.strategies import parse_strategies

    config = load_config(args.config, overrides=args.set or [])
    specs = parse_strategies(args.strategies)
    for flag, value, low in (("--devices", args.devices, 1), ("--steps", args.steps, 1),
                             ("--warmup", args.warmup, 0)):
        if value is not None and value < low:
            raise UsageError(f"{flag} must be >= {low}, got {value}")
    topology = aot_topology(args, config) if args.aot else None
    if topology is None:
        simulate(args.simulate_devices)
        add_xla_flags(config.xla.flags)  # --aot: the Trainer gives GPU flags per compile
    apply_precision(config)
    from jaxmp._util.log import say
    from jaxmp.tools.bench import bench_gpt
    from jaxmp.tools.bench_output import json_text, render, write_outputs

    if topology is not None:
        from jaxmp.topology import without_persistent_cache

        without_persistent_cache()  # a deviceless executable cannot be read back from it
        devices = list(topology.devices)
    else:
        devices = present_devices(device_count(args))
    result = bench_gpt(config, specs, devices, steps=args.steps, warmup=args.warmup, log=say,
                       device_kind=topology.target.kind if topology else args.device_kind,
                       aot=topology is not None)
    written = write_outputs(result, Path(args.out)) if args.out else []
    if args.json:
        print(json_text(result), end="")
    else:
        print(render(result))
        for path in written:
            print(f"wrote {path}")
    return 0
