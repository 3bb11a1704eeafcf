"""``jaxmp plan [CONFIG] [--devices N] [--device-kind K] [--json] [--verify]``.

Imports nothing heavy at module load: ``--verify`` compiles on N simulated CPU devices, which
XLA only provides if ``--xla_force_host_platform_device_count=N`` is in ``XLA_FLAGS`` before
jax starts, so :func:`prepare_environment` runs first (the main CLI may call it too).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any

from jaxmp.plan.errors import PlanUsageError

DEFAULT_VERIFY_DEVICES = 8


def add_plan_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "plan", help="choose a mesh from per-layer costs and show the predictions",
        description="Measure the configured model's per-layer costs, rank every mesh "
                    "factorisation of the devices, and print the chosen plan.")
    p.add_argument("config", nargs="?", default=None, help="TOML config (default: built-in tiny)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key")
    p.add_argument("--devices", type=int, default=None, metavar="N",
                   help="devices to plan for (default: this host's devices; with --verify 8)")
    p.add_argument("--device-kind", default=None, metavar="KIND",
                   help="device profile, e.g. H100, A100-80GB (default: detected)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--verify", action="store_true",
                   help="compile the train step on N simulated CPU devices and compare")
    p.add_argument("--top", type=int, default=5, metavar="K", help="alternatives to show")
    p.set_defaults(func=run_plan)
    return p


def prepare_environment(args: argparse.Namespace) -> None:
    """With ``--verify``, give the CPU backend enough devices.

    Works until jax's backend starts (importing jax is fine; calling ``jax.devices()`` is
    too late): afterwards ``--verify`` reports the shortfall instead.
    """
    if args.devices is not None and args.devices < 1:
        raise PlanUsageError(f"--devices must be >= 1, got {args.devices}")
    if not args.verify:
        return
    n = args.devices or DEFAULT_VERIFY_DEVICES
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={n}"])
    os.environ["JAX_PLATFORMS"] = "cpu"
    if "jax" in sys.modules:  # imported but maybe not started: the env var was read already
        try:
            sys.modules["jax"].config.update("jax_platforms", "cpu")
        except Exception:  # noqa: BLE001 - already started: verify reports what it finds
            pass


def run_plan(args: argparse.Namespace) -> int:
    """The ``jaxmp plan`` command; returns the exit code (bad input raises ValueError)."""
    from jaxmp.config import load_config

    config = load_config(args.config, overrides=args.set or [])
    prepare_environment(args)
    if args.top < 0:
        raise PlanUsageError(f"--top must be >= 0, got {args.top}")
    import jax

    from jaxmp.planner import plan_for_config

    n = args.devices or (DEFAULT_VERIFY_DEVICES if args.verify else len(jax.devices()))
    result = plan_for_config(config, n, device_kind=args.device_kind)
    result.alternatives = result.alternatives[:args.top]
    if args.verify:
        from jaxmp.plan.verify import verify_prediction

        result.verify = verify_prediction(config, result.mesh, result.predicted)
    if args.json:
        print(json.dumps(result.to_json(), indent=2, default=_json_default))
    else:
        print(render(result, config))
    return 0


def _json_default(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return str(x)


def _b(x: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(x) >= size:
            return f"{x / size:.2f} {unit}"
    return f"{x:.0f} B"


def _t(s: float) -> str:
    return f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"


def _mesh(m: dict) -> str:
    return " x ".join(f"{k}={v}" for k, v in m.items() if v > 1) or "single device"


def render(plan: Any, config: Any) -> str:
    """The human-readable report: layer table, chosen plan, alternatives, verification."""
    p = plan.predicted
    dev = plan.device
    lines = [f"jaxmp plan: {plan.n_devices} x {dev.kind} (peak {dev.peak_flops:.3g} FLOP/s, "
             f"{_b(plan.memory_limit)} usable per device); global batch "
             f"{config.train.batch_size} x {config.data.seq_len} tokens", "",
             "per-layer costs (whole global batch, remat none; a stack's blocks: per block):",
             f"  {'layer':<16}{'fwd GFLOP':>11}{'bwd GFLOP':>11}{'params':>13}{'saved':>12}"
             f"{'output':>12}"]
    runs: list[list[dict]] = []
    for lay in plan.layers:  # identical blocks of a stack: one row
        if runs and lay.get("group", lay["name"]) == runs[-1][-1].get("group", "") \
                and lay.get("group") != lay["name"]:
            runs[-1].append(lay)
        else:
            runs.append([lay])
    rows = [(run[0]["name"] if len(run) == 1 else
             f"{run[0]['name']}..{run[-1]['name'].rsplit('/', 1)[-1]} x{len(run)}", run[0])
            for run in runs]
    for name, lay in rows:
        lines.append(f"  {name:<16}{lay['fwd_flops'] / 1e9:>11.3f}"
                     f"{lay['bwd_flops'] / 1e9:>11.3f}{lay['param_count']:>13,.0f}"
                     f"{_b(lay['saved_bytes'].get('none', 0.0)):>12}"
                     f"{_b(lay['boundary_bytes']):>12}")
    status = "runnable" if plan.runnable else "not runnable"
    fits = "fits" if plan.fits else "DOES NOT FIT"
    lines += ["", f"chosen: {_mesh(plan.mesh)}  (remat {plan.remat}, {plan.microbatches} "
                  f"microbatch{'es' if plan.microbatches > 1 else ''}; {status}; {fits})",
              f"  stages {plan.stages}",
              f"  per device {_b(p.per_device_bytes)}: params {_b(p.param_bytes)}, optimizer "
              f"{_b(p.optimizer_bytes)}, grads+update {_b(p.grad_bytes)}, activations "
              f"{_b(p.activation_bytes)}, working {_b(p.working_bytes)}",
              f"  step {_t(p.step_time_s)}: compute {_t(p.compute_s)}, bubble {_t(p.bubble_s)}, "
              + ", ".join(f"{a} {_t(s)}" for a, s in p.comm_s.items() if s),
              f"  {p.flops_per_step:.4g} FLOP/step, {_b(p.comm_bytes_per_step)} sent per device "
              f"per step"]
    if plan.alternatives:
        lines += ["", "alternatives:"]
        for i, alt in enumerate(plan.alternatives, 1):
            lines.append(f"  {i}. {_mesh(alt['mesh'])} (remat {alt['remat']}, "
                         f"{alt['microbatches']} mb): {_t(alt['predicted']['step_time_s'])}, "
                         f"{_b(alt['predicted']['per_device_bytes'])} - {alt['reason']}")
    if plan.dropped:
        lines.append("  dropped: " + "; ".join(f"{k} ({v})" for k, v in plan.dropped.items()))
    for note in plan.notes:
        lines.append(f"note: {note}")
    if plan.verify:
        v = plan.verify
        lines += ["", f"verify (compiled on {plan.n_devices} simulated CPU devices):",
                  f"  {'':<22}{'predicted':>14}{'compiled':>14}{'rel err':>9}"]
        for key in ("argument_bytes", "peak_bytes", "comm_bytes_per_step"):
            r = v[key]
            lines.append(f"  {key:<22}{_b(r['predicted']):>14}{_b(r['compiled']):>14}"
                         f"{r['rel_err']:>9.1%}")
    lines.append(f"\nplanned in {plan.planning_time_s:.3f} s (cost model {plan.cost_time_s:.2f} s)")
    return "\n".join(lines)
