"""``jaxmp plan [CONFIG] [--devices N] [--device-kind K] [--json] [--verify] [--compare L]``.

``--verify`` compiles on N simulated CPU devices, which XLA only provides if asked before jax's
backend starts, so the environment is settled first.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from jaxmp.cli.train import add_config_arguments
from jaxmp.errors import UsageError

DEFAULT_VERIFY_DEVICES = 8


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "plan", help="choose a mesh from per-layer costs and show the predictions",
        description="Measure the configured model's per-layer costs, rank every mesh "
                    "factorisation of the devices, and print the chosen plan.")
    add_config_arguments(p)
    p.add_argument("--devices", type=int, default=None, metavar="N",
                   help="devices to plan for (default: this host's devices; with --verify 8)")
    p.add_argument("--device-kind", default=None, metavar="KIND",
                   help="device profile, e.g. H100, A100-80GB (default: detected)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--verify", action="store_true",
                   help="compile the train step on N simulated CPU devices and compare")
    p.add_argument("--top", type=int, default=5, metavar="K", help="alternatives to show")
    p.add_argument("--compare", default=None, metavar="LAYOUT",
                   help="print the chosen plan beside a given layout, term by term, e.g. "
                        "data=6,stage=64,tensor=8 (also remat=, schedule=, virtual=, "
                        "microbatches=)")
    p.set_defaults(func=run)
    return p


def _prepare(args: argparse.Namespace) -> None:
    """Check the numbers; with ``--verify``, give the CPU backend enough devices (until jax's
    backend starts; afterwards ``--verify`` reports the shortfall instead)."""
    from jaxmp._util.env import simulate_devices

    if args.devices is not None and args.devices < 1:
        raise UsageError(f"--devices must be >= 1, got {args.devices}")
    if args.top < 0:
        raise UsageError(f"--top must be >= 0, got {args.top}")
    if args.compare is not None:
        args.compare = parse_layout(args.compare)
    if args.verify:
        try:
            simulate_devices(args.devices or DEFAULT_VERIFY_DEVICES)
        except RuntimeError:
            pass  # jax already started (e.g. called in-process): verify says what it found


def run(args: argparse.Namespace) -> int:
    """The ``jaxmp plan`` command; returns the exit code (bad input raises BadInput)."""
    from jaxmp.recipes.gpt_config import load_config

    config = load_config(args.config, overrides=args.set or [])
    _prepare(args)
    import jax

    from jaxmp.config import replace
    from jaxmp.plan.render import render, render_compare
    from jaxmp.recipes.gpt import gpt_plan, gpt_trainer
    from jaxmp.tools.verify import verify_prediction

    n = args.devices or (DEFAULT_VERIFY_DEVICES if args.verify else len(jax.devices()))
    result = gpt_plan(config, n, device_kind=args.device_kind)
    result.alternatives = result.alternatives[:args.top]
    given = result.compare(args.compare) if args.compare is not None else None
    if args.verify:
        fixed = replace(config, mesh=dict(result.mesh))
        result.verify = verify_prediction(
            lambda devices: gpt_trainer(fixed, devices=devices, with_data=False, plan=result),
            result.mesh, result.predicted, jax.devices())
    if args.json:
        out = result.to_json()
        if given is not None:
            out["compare"] = {"mesh": given.mesh, "remat": given.layout.remat,
                              "schedule": given.prediction.schedule,
                              "virtual_stages": given.layout.virtual,
                              "microbatches": given.layout.microbatches, "fits": given.fits,
                              "runnable": given.runnable, "blockers": list(given.blockers),
                              "predicted": given.prediction.to_dict()}
        print(json.dumps(out, indent=2, default=_json_default))
    else:
        print(render(result, f"{config.train.batch_size} x {config.data.seq_len} tokens"))
        if given is not None:
            print("\n" + render_compare(result, given))
    return 0


def parse_layout(text: str) -> dict[str, Any]:
    """``"data=6,stage=64,tensor=8,remat=full"`` -> a dict (integers where the key takes one)."""
    out: dict[str, Any] = {}
    for part in filter(None, (x.strip() for x in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or not value:
            raise UsageError(f"--compare: expected KEY=VALUE pairs separated by commas, "
                             f"got {part!r}")
        if key in ("remat", "schedule"):
            out[key] = value
            continue
        try:
            out[key] = int(value)
        except ValueError:
            raise UsageError(f"--compare: {key} must be an integer, got {value!r}") from None
        if out[key] < 1:
            raise UsageError(f"--compare: {key} must be >= 1, got {value!r}")
    return out


def _json_default(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return str(x)
