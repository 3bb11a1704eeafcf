"""``jaxmp plan [CONFIG] [--devices N] [--simulate-devices N] [--device-kind K] [--json]
[--verify [--aot] [--dump-hlo DIR]] [--compare KEY=VALUE,...]``.

``--devices N`` plans for N devices (default: those present); ``--verify`` builds the Trainer
from the very plan printed on the first N devices present and compiles its step — on a machine
without them, ``--simulate-devices N`` gives the CPU backend N devices (before jax starts).
``--aot`` compiles it instead for N deviceless GPUs of ``--device-kind`` with XLA's GPU
compiler (JAX's CUDA plugin; JAX runs on the CPU, set before it starts): ``tools/aot.py``.
``--compare`` plans again with more config keys fixed and prints both plans side by side.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from jaxmp.cli.train import add_config_arguments, add_device_arguments
from jaxmp.errors import UsageError

# --compare's old short keys and the config keys they mean (docs and scripts used them).
OLD_COMPARE_KEYS = {"data": "mesh.data", "stage": "mesh.stage", "fsdp": "mesh.fsdp",
                    "tensor": "mesh.tensor", "remat": "model.remat",
                    "schedule": "pipeline.schedule", "virtual": "pipeline.virtual_stages",
                    "microbatches": "train.microbatches"}


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "plan", help="choose a mesh from per-layer costs and show the predictions",
        description="Measure the configured model's per-layer costs, rank every mesh "
                    "factorisation of the devices, and print the chosen plan.")
    add_config_arguments(p)
    add_device_arguments(p, "to plan for")
    p.add_argument("--device-kind", default=None, metavar="KIND",
                   help="device profile, e.g. H100, A100-80GB (default: detected)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--verify", action="store_true",
                   help="build the Trainer from this plan on the first N devices present, "
                        "compile its step and compare")
    p.add_argument("--aot", action="store_true",
                   help="with --verify: compile for --devices N deviceless GPUs of --device-kind "
                        "with XLA's GPU compiler, here, without a GPU (needs JAX's CUDA plugin: "
                        'pip install -e ".[cuda]")')
    p.add_argument("--dump-hlo", default=None, metavar="DIR",
                   help="with --verify: write the compiled step's HLO text into DIR")
    p.add_argument("--top", type=int, default=5, metavar="K", help="alternatives to show")
    p.add_argument("--compare", default=None, metavar="KEY=VALUE,...",
                   help="plan again with these config keys fixed and print it beside the chosen "
                        "plan, term by term, e.g. mesh.data=6,mesh.stage=64,mesh.tensor=8,"
                        "model.remat=full,pipeline.schedule=interleaved,train.microbatches=512")
    p.set_defaults(func=run)
    return p


def compare_overrides(text: str) -> list[str]:
    """``--compare``'s ``KEY=VALUE`` pairs as config overrides; the old short keys (``data=``,
    ``remat=``, ...) still work, with one deprecation line."""
    out, old = [], []
    for part in filter(None, (x.strip() for x in text.split(","))):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or not value.strip() or not key:
            raise UsageError(f"--compare: expected KEY=VALUE pairs separated by commas, "
                             f"got {part!r}")
        if key in OLD_COMPARE_KEYS:
            old.append(f"{key}= (now {OLD_COMPARE_KEYS[key]}=)")
            key = OLD_COMPARE_KEYS[key]
        elif "." not in key:
            raise UsageError(f"--compare: {key!r} is not a config key (section.key, e.g. "
                             f"mesh.data)")
        out.append(f"{key}={value.strip()}")
    if old:
        print(f"jaxmp: warning: --compare: deprecated key(s) {', '.join(old)}", file=sys.stderr)
    return out


def run(args: argparse.Namespace) -> int:
    """The ``jaxmp plan`` command; returns the exit code (bad input raises BadInput)."""
    from jaxmp.cli.train import device_count, present_devices, simulate
    from jaxmp.recipes.gpt_config import load_config

    config = load_config(args.config, overrides=args.set or [])
    if args.top < 0:
        raise UsageError(f"--top must be >= 0, got {args.top}")
    given_sets = compare_overrides(args.compare) if args.compare is not None else None
    given_config = load_config(args.config, overrides=[*(args.set or []), *given_sets]) \
        if given_sets is not None else None
    topology = aot_topology(args, config) if args.aot else None
    if args.dump_hlo is not None and not (args.verify or args.aot):
        raise UsageError("--dump-hlo writes the step --verify compiles: add --verify")
    simulate(args.simulate_devices)
    n = device_count(args)
    devices = present_devices(n) if args.verify and topology is None else None
    kind = topology.target.kind if topology is not None else args.device_kind

    from jaxmp.plan.render import render, render_compare
    from jaxmp.recipes.gpt import gpt_plan, gpt_trainer
    from jaxmp.config.sections import REMAT_POLICY_NAMES
    from jaxmp.tools.aot import aot_verify
    from jaxmp.tools.verify import verify_prediction

    platform = planned_platform(config, kind, topology is not None or not args.verify)

    def plan_of(cfg: Any, find_devices_needed: bool = True) -> Any:
        return gpt_plan(cfg, n, kind, remats=REMAT_POLICY_NAMES, strict=True,
                        measure_cpu=True, top=args.top, find_devices_needed=find_devices_needed,
                        platform=platform)

    result = plan_of(config)
    given = plan_of(given_config, False) if given_config is not None else None
    make = lambda devs: gpt_trainer(config, devices=devs, with_data=False,  # noqa: E731
                                    plan=result)
    if topology is not None:
        result.verify = aot_verify(make, result, topology, args.dump_hlo)
    elif args.verify:
        result.verify = verify_prediction(make, result, devices, args.dump_hlo)
    if args.json:
        out = result.to_json()
        if given is not None:
            out["compare"] = {k: v for k, v in given.to_json().items()
                              if k not in ("layers", "param_specs", "rules", "alternatives")}
        print(json.dumps(out, indent=2, default=_json_default))
    else:
        print(render(result, f"{config.train.batch_size} x {config.data.seq_len} tokens"))
        if given is not None:
            print("\n" + render_compare(result, given))
    return 0


def planned_platform(config: Any, kind: str | None, elsewhere: bool) -> str | None:
    """The platform the plan is for: ``"cuda"`` when it is for GPUs of a known kind
    (``--device-kind`` or ``device.kind``) that are not this process's devices (no
    ``--verify`` here, or ``--aot``) — the kernels ``jaxmp train`` picks there, e.g. cuDNN
    attention, not the ones this login node could run; else None (this process's devices)."""
    from jaxmp.devices import match_kind
    from jaxmp.gpu_targets import TARGETS

    kind = kind or (config.device.kind if config.device.kind not in ("", "auto") else None)
    return "cuda" if elsewhere and kind and match_kind(kind) in TARGETS else None


def aot_topology(args: argparse.Namespace, config: Any) -> Any:
    """``--aot``'s deviceless GPUs: ``--devices`` of ``--device-kind`` (else ``device.kind``)
    in hosts of the profile's (or ``device.devices_per_host``) size. JAX is set to the CPU
    first (before it starts), and JAX's CUDA plugin is required: bad input without it."""
    from jaxmp._util.env import use_cpu

    if args.simulate_devices is not None:
        raise UsageError("--aot compiles for deviceless GPUs: drop --simulate-devices")
    if args.devices is None:
        raise UsageError("--aot needs --devices N (the GPUs to compile for)")
    kind = args.device_kind or (config.device.kind if config.device.kind != "auto" else None)
    if kind is None:
        raise UsageError("--aot needs --device-kind KIND (a GPU profile, e.g. H100, A100-80GB)")
    use_cpu()
    from jaxmp.topology import gpu_topology, require_cuda_plugin

    require_cuda_plugin("--aot")
    return gpu_topology(args.devices, kind, config.device.devices_per_host or None)


def _json_default(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return str(x)
