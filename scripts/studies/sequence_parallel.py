"""Sequence parallelism off / on: per-device bytes of the compiled step, and its step time.

    python scripts/measure.py sequence-parallel --simulate-devices 8         # 8 CPU devices
    python scripts/measure.py sequence-parallel --simulate-devices 8 --gpu   # + 8 x H100

Prints docs/benchmarks.md's tables: for each mesh, the planner's prediction and the compiled
step's argument, temporary and collective bytes per device with ``train.sequence_parallel``
false and true (on the devices: the test-size GPT at sequence 256; ``--gpu``: the GPU compiler
for 8 deviceless H100s, a 4-layer 2048-wide GPT at sequence 2048 in bf16, which needs the CPU
backend — ``--simulate-devices`` gives it — and JAX's CUDA plugin), then the step time on
the devices: the two steps run interleaved A B A B (``--rounds`` rounds of ``--steps``
steps each after a warm-up), the ratio on / off per round, its median and spread.

    python scripts/measure.py sequence-parallel --simulate-devices 8 --collective-matmul

times the ring collective matmuls (``model.collective_matmul`` true) against the
partitioner's all-gathers / reduce-scatters (false), sequence parallelism on, data 2 x tensor 4.
"""
from __future__ import annotations

import argparse
import statistics
import time

from studies import common
from studies.common import devices as present

DOC = "docs/benchmarks.md"
DEVICES = True  # the CPU rows and the timing run on 8 of them

CPU = ["model.layers=8", "model.d_model=128", "model.heads=8", "model.vocab_size=256",
       "data.seq_len=256", "train.batch_size=16", "data.source=synthetic"]
GPU = ["model.layers=4", "model.d_model=2048", "model.heads=16", "model.vocab_size=1024",
       "model.compute_dtype=bfloat16", "data.seq_len=2048", "data.source=synthetic",
       "train.batch_size=8", "model.remat=none"]
MESHES = [{"data": 2, "tensor": 4}, {"tensor": 8}, {"stage": 2, "data": 2, "tensor": 2}]


def mesh_sets(axes: dict) -> list[str]:
    """The mesh fixed; with stages, 4 microbatches of the pipeline (1F1B)."""
    microbatches = 4 if axes.get("stage", 1) > 1 else 1
    return common.mesh_sets(axes) + [f"train.microbatches={microbatches}"]


def build(sets: list[str], sp: str, devices: list, **plan_kw):
    import jaxmp
    from jaxmp.recipes.gpt import gpt_plan, gpt_trainer

    config = jaxmp.load_config(None, sets + [f"train.sequence_parallel={sp}"])
    plan = gpt_plan(config, len(devices), **plan_kw)
    return gpt_trainer(config, devices=devices, with_data=False, plan=plan), plan


def byte_rows(sets: list[str], devices: list, label: str, meshes: list[dict],
              **plan_kw) -> list[list[str]]:
    from jaxmp._util.fmt import fmt_bytes
    from jaxmp.tools.measure import measure_step

    rows = []
    for axes in meshes:
        for sp in ("false", "true"):
            trainer, plan = build(sets + mesh_sets(axes), sp, devices, **plan_kw)
            m, p = measure_step(trainer), plan.predicted
            mesh = "x".join(f"{a}{n}" for a, n in axes.items())
            rows.append([label, mesh, "on" if plan.layout.sequence_parallel else "off",
                         plan.describe(), fmt_bytes(p.argument_bytes), fmt_bytes(m.argument_bytes),
                         fmt_bytes(p.per_device_bytes - p.argument_bytes),
                         fmt_bytes(m.temp_bytes), f"{p.comm_bytes_per_step / 2**20:,.2f} MiB",
                         f"{m.collectives.total_bytes / 2**20:,.2f} MiB"])
            print(" | ".join(rows[-1]), flush=True)
    return rows


def timing(devices: list, axes: dict, rounds: int, steps: int,
           variants: tuple[tuple[list[str], str], ...] = (([], "false"), ([], "true"))) -> None:
    """Step time on / off (``variants``: extra settings and train.sequence_parallel of each),
    the two compiled steps run interleaved in one process."""
    import jax

    from jaxmp.tools.bench import random_batch
    from jaxmp.train.state import init_state
    from jaxmp.train.step import batch_sharding

    runs = []
    for extra, sp in variants:
        trainer, _ = build(CPU + mesh_sets(axes) + extra, sp, devices)
        batch = random_batch(trainer.example_batch, high=256)
        batch = jax.device_put(batch, batch_sharding(trainer.layout, trainer.step_rules, batch))
        step = trainer.compile(batch)
        state = init_state(trainer.layout, trainer.model_fn, trainer.tx, 0)
        state, m = step(state, batch)
        jax.block_until_ready(m)
        runs.append([step, state, batch])
    times: list[list[float]] = [[], []]
    for _ in range(rounds):
        for i, run in enumerate(runs):
            step, state, batch = run
            start = time.perf_counter()
            for _ in range(steps):
                state, m = step(state, batch)
            jax.block_until_ready((state, m))
            times[i].append((time.perf_counter() - start) / steps)
            run[1] = state
    ratios = [on / off for off, on in zip(*times)]
    mesh = "x".join(f"{a}{n}" for a, n in axes.items())
    print(f"{mesh}: step time off median {statistics.median(times[0]) * 1e3:.1f} ms, on "
          f"{statistics.median(times[1]) * 1e3:.1f} ms; on / off per round: median "
          f"{statistics.median(ratios):.3f}, min {min(ratios):.3f}, max {max(ratios):.3f} "
          f"({rounds} rounds x {steps} steps)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpu", action="store_true", help="also compile for 8 deviceless H100s")
    p.add_argument("--rounds", type=int, default=7, help="0: bytes only, no timing")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--collective-matmul", action="store_true",
                   help="time model.collective_matmul false (off) / true (on), sequence "
                        "parallelism on, instead of the study above")


def run(args: argparse.Namespace) -> int:
    devices = present(args, at_least=8)[:8]
    if args.collective_matmul:  # the rings (jaxmp.sharding.ring) against the partitioner's
        timing(devices, MESHES[0], args.rounds, args.steps,
               tuple(([f"model.collective_matmul={on}"], "true") for on in ("false", "true")))
        return 0
    backend = devices[0].platform.upper()
    head = ["backend", "mesh", "SP", "plan", "args pred", "args", "temp pred", "temp",
            "collectives pred", "collectives"]
    rows = byte_rows(CPU, devices, backend, MESHES)
    if args.gpu:
        from jaxmp.topology import gpu_topology, without_persistent_cache

        without_persistent_cache()
        # not the pipeline: cuDNN's attention does not lower inside the executor's shard_map
        rows += byte_rows(GPU, list(gpu_topology(8, "H100").devices), "GPU (H100, deviceless)",
                          MESHES[:2], device_kind="H100", platform="cuda")
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for r in rows:
        print("| " + " | ".join(r) + " |")
    if args.rounds:
        timing(devices, MESHES[0], args.rounds, args.steps)
    return 0
