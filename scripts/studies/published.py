"""Published training runs as jaxmp predicts them, and the layout it chooses instead.

    python scripts/measure.py published

Regenerates docs/planner.md's table "published run -> jaxmp's prediction". For each published
run (jaxmp/recipes/published.py): the layout it used as jaxmp predicts it (per-device memory,
step time and its error against the published one), and the layout jaxmp chooses instead.
Planning only: nothing is compiled. Also plans GPT-3 175B on 1024 H100s.
"""

from __future__ import annotations

import argparse
import sys
import time

DOC = "docs/planner.md"
DEVICES = False  # planning only: each run's own device count and kind


def add_arguments(p: argparse.ArgumentParser) -> None:
    """No options: the runs are jaxmp/recipes/published.py's."""


def run(args: argparse.Namespace) -> int:
    from jaxmp._util.fmt import fmt_bytes, fmt_time, mesh_str
    from jaxmp.recipes.gpt import gpt_costs, gpt_plan
    from jaxmp.recipes.published import GPT3_175B, RUNS, evaluate
    from jaxmp.recipes.gpt_config import load_config

    print("| run | devices | published | published layout as jaxmp predicts it: memory per "
          "device | step time (error) | jaxmp's choice | its step time |\n"
          "|---|---|---|---|---|---|---|")
    for run in RUNS:
        start = time.perf_counter()
        ev = evaluate(run)
        g, p = ev.given, ev.plan
        mem = (f"{fmt_bytes(g.predicted.per_device_bytes)} of "
               f"{fmt_bytes(p.memory_limit)}: {'fits' if g.fits else 'DOES NOT FIT'}")
        step = f"{fmt_time(g.predicted.step_time_s)} ({ev.error:+.0%})"
        print(f"| {run.name} | {run.devices} x {run.device} | {run.published}: "
              f"{fmt_time(run.step_time_s)} per step | {mesh_str(g.mesh)}, {g.describe()}"
              f": {mem} | {step} | {mesh_str(p.mesh)}, {p.describe()} "
              f"({'fits' if p.fits else 'DOES NOT FIT'}) | "
              f"{fmt_time(p.predicted.step_time_s)} |", flush=True)
        print(f"{run.name}: {time.perf_counter() - start:.1f} s", file=sys.stderr)
    config = load_config(None, list(GPT3_175B))
    start = time.perf_counter()
    gpt_costs(config)
    p = gpt_plan(config, 1024, device_kind="H100")
    print(f"\nGPT-3 175B, batch 1536 x 2048, 1024 x H100 (75 % of memory usable): "
          f"{mesh_str(p.mesh)}, {p.describe()}: {fmt_bytes(p.predicted.per_device_bytes)} "
          f"per device ({'fits' if p.fits else 'DOES NOT FIT'}), step "
          f"{fmt_time(p.predicted.step_time_s)}; planned in {p.planning_time_s:.1f} s "
          f"({time.perf_counter() - start:.1f} s with the cost model)")
    return 0

