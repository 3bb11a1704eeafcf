"""``jaxmp bench [CONFIG] [--devices N] [--strategies a,b,...] [--steps K] [--json] [--out DIR]``.

``--devices N`` asks the CPU backend for N devices before jax starts (as ``jaxmp plan --verify``
does) without forcing the CPU: on a host with accelerators the first N of them are used.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from jaxmp.cli.train import add_config_arguments
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
    p.add_argument("--devices", type=int, default=None, metavar="N",
                   help="devices to use (default: all; on CPU, N simulated devices)")
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
    p.set_defaults(func=run)
    return p


def _devices(wanted: int | None) -> list:
    import jax

    have = jax.devices()
    if wanted is not None and len(have) < wanted:
        raise UsageError(f"--devices {wanted}: this process has {len(have)} "
                         f"{have[0].platform} device(s) (simulated CPU devices must be "
                         f"requested before jax starts)")
    return list(have[:wanted] if wanted else have)


def run(args: argparse.Namespace) -> int:
    from jaxmp._util.env import add_xla_flags, simulate_devices
    from jaxmp.cli.train import apply_precision
    from jaxmp.recipes.gpt_config import load_config
    from jaxmp.tools.strategies import parse_strategies

    config = load_config(args.config, overrides=args.set or [])
    specs = parse_strategies(args.strategies)
    for flag, value, low in (("--devices", args.devices, 1), ("--steps", args.steps, 1),
                             ("--warmup", args.warmup, 0)):
        if value is not None and value < low:
            raise UsageError(f"{flag} must be >= {low}, got {value}")
    if args.devices is not None:
        try:
            simulate_devices(args.devices, force_cpu=False)
        except RuntimeError:
            pass  # jax already started (called in-process): _devices says what it found
    add_xla_flags(config.xla.flags)
    apply_precision(config)
    from jaxmp._util.log import say
    from jaxmp.tools.bench import bench_gpt
    from jaxmp.tools.bench_output import json_text, render, write_outputs

    result = bench_gpt(config, specs, _devices(args.devices), steps=args.steps,
                       warmup=args.warmup, log=say)
    written = write_outputs(result, Path(args.out)) if args.out else []
    if args.json:
        print(json_text(result), end="")
    else:
        print(render(result))
        for path in written:
            print(f"wrote {path}")
    return 0
