"""Bytes per device with the optimizer state replicated over data and sharded over it.

    python scripts/measure.py optimizer-sharding cpu --simulate-devices 8
    python scripts/measure.py optimizer-sharding gpu    # 32 deviceless H100s (CUDA plugin)
    python scripts/measure.py optimizer-sharding time --simulate-devices 8

``train.optimizer_sharding`` none / data, the planner's prediction beside the compiled number:
per-device argument, temporary and collective bytes of the train step (``cpu``: the test GPT
on 8 devices; ``gpu``: a 175B-wide slice compiled by XLA's GPU compiler for 32 deviceless
H100s, ``jaxmp.topology.gpu_topology``, its collective bytes read from the compiled HLO), or
the step time off and on, interleaved (``time``, 8 devices). Every config pins
``train.sequence_parallel=false``: the layouts with ``tensor`` > 1 would otherwise turn it on
("auto"), and docs/benchmarks.md's numbers isolate the optimizer sharding.
"""

from __future__ import annotations

import argparse
import time

from studies.common import devices

DOC = "docs/benchmarks.md"
DEVICES = True  # cpu and time run on 8 of them; gpu compiles for 32 deviceless H100s instead
NO_SP = ["train.sequence_parallel=false"]  # measured before sequence parallelism existed

CPU_GPT = ["model.layers=2", "model.d_model=64", "model.heads=8", "model.mlp_dim=256",
           "model.vocab_size=256", "model.tie_embeddings=false", "data.seq_len=16",
           "train.batch_size=16", "checkpoint.enabled=false", *NO_SP]
CPU_MESHES = [["mesh.data=8"], ["mesh.data=4", "mesh.tensor=2"],
              ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"],
              ["mesh.data=8", "train.microbatches=2"],
              ["mesh.data=2", "mesh.stage=2", "mesh.tensor=2", "train.microbatches=4",
               "pipeline.balance=layers", "model.layers=4"]]
# GPT-3 175B's width (12288, 96 heads, vocab 50304, seq 2048) at 8 layers: 2 per stage on
# data 2 x stage 4 x tensor 4 = 32 H100s, bf16, remat full, 1F1B with 8 microbatches; XLA's
# attention (cuDNN's custom partitioning fails inside the pipeline's shard_map on jax 0.10).
GPU_GPT = ["model.layers=8", "model.d_model=12288", "model.heads=96", "model.vocab_size=50304",
           "data.seq_len=2048", "train.batch_size=16", "model.compute_dtype=bfloat16",
           "model.param_dtype=float32", "model.remat=full", "checkpoint.enabled=false",
           "data.source=synthetic", "mesh.data=2", "mesh.stage=4", "mesh.tensor=4",
           "mesh.fsdp=1", "pipeline.schedule=1f1b", "train.microbatches=8",
           "pipeline.balance=layers", "model.attention=xla", *NO_SP]
# The same width without stages: 2 layers on data 4 x tensor 8 (XLA reduces the gradients),
# cuDNN's flash attention.
GPU_FLAT = [s for s in GPU_GPT if not s.startswith(("model.layers", "mesh.", "pipeline.",
                                                     "train.microbatches", "model.attention"))] + [
    "model.layers=2", "mesh.data=4", "mesh.tensor=8", "mesh.stage=1", "mesh.fsdp=1",
    "train.microbatches=1", "model.attention=cudnn"]
GPU_CASES = {"175B-wide, 8 layers, data2 x stage4 x tensor4, 32 x H100": GPU_GPT,
             "175B-wide, 2 layers, data4 x tensor8, 32 x H100, cuDNN attention": GPU_FLAT}


def _row(label: str, trainer, measured, seconds: float) -> str:
    from jaxmp._util.fmt import fmt_bytes

    p = trainer.plan.predicted
    pred_temp = p.per_device_bytes - p.argument_bytes
    return (f"| {label} | {trainer.plan.layout.optimizer_sharding} | "
            f"{fmt_bytes(measured.argument_bytes)} ({fmt_bytes(p.argument_bytes)}) | "
            f"{fmt_bytes(measured.temp_bytes)} ({fmt_bytes(pred_temp)}) | "
            f"{fmt_bytes(measured.collective_bytes)} ({fmt_bytes(p.comm_bytes_per_step)}) | "
            f"{seconds:.0f} s |")


TIME_GPT = ["model.layers=4", "model.d_model=256", "model.heads=8", "model.vocab_size=1024",
            "data.seq_len=128", "train.batch_size=32", "checkpoint.enabled=false",
            "data.source=synthetic", "mesh.data=8", "mesh.fsdp=1", "mesh.tensor=1",
            "mesh.stage=1", *NO_SP]


def step_times(devs: list, rounds: int = 7, steps: int = 5) -> int:
    """Seconds per step, off and on, in alternating rounds (A B A B ...): median and range."""
    import statistics

    import jax
    import jaxmp
    from jaxmp.recipes.gpt import gpt_trainer, lm_batches
    from jaxmp.train.state import init_state

    runs = {}
    for zero in ("none", "data"):
        config = jaxmp.load_config(None, TIME_GPT + [f"train.optimizer_sharding={zero}"])
        t = gpt_trainer(config, "unused", devices=devs)
        batch = t._to_global(next(iter(lm_batches(config))))
        state = init_state(t.layout, t.model_fn, t.tx, 0)
        runs[zero] = [t.compile(batch), state, batch, []]
    for _ in range(rounds):
        for zero, run in runs.items():
            step, state, batch, times = run
            state, m = step(state, batch)  # warm
            jax.block_until_ready(m["loss"])
            start = time.perf_counter()
            for _ in range(steps):
                state, m = step(state, batch)
            jax.block_until_ready(m["loss"])
            times.append((time.perf_counter() - start) / steps)
            run[1] = state
    med = {z: statistics.median(r[3]) for z, r in runs.items()}
    for zero, run in runs.items():
        print(f"| {zero} | {med[zero] * 1e3:.1f} ms | {min(run[3]) * 1e3:.1f}-"
              f"{max(run[3]) * 1e3:.1f} ms |")
    print(f"on / off: {med['data'] / med['none']:.3f}")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("part", nargs="?", default="cpu", choices=["cpu", "gpu", "time"],
                   help="cpu: bytes on 8 devices; gpu: bytes on 32 deviceless H100s; time: "
                        "step time on 8 devices (default %(default)s)")


def run(args: argparse.Namespace) -> int:
    where = args.part
    if where == "gpu":
        from jaxmp._util.env import use_cpu

        use_cpu()  # the CUDA plugin compiles for absent GPUs; it must not look for a driver
    devs = [] if where == "gpu" else devices(args, at_least=8)[:8]
    if where == "time":
        return step_times(devs)
    import jaxmp
    from jaxmp.recipes.gpt import gpt_plan, gpt_trainer
    from jaxmp.tools.measure import measure_step

    print("| layout | optimizer | argument bytes (predicted) | temporary bytes (predicted) | "
          "collective bytes (predicted) | compile |\n|---|---|---|---|---|---|")
    cases = [(" ".join(s.removeprefix("mesh.") for s in m), CPU_GPT + m) for m in CPU_MESHES] \
        if where == "cpu" else list(GPU_CASES.items())
    for label, base in cases:
        for zero in ("none", "data"):
            sets = base + [f"train.optimizer_sharding={zero}"]
            config = jaxmp.load_config(None, sets)
            start = time.perf_counter()
            if where == "cpu":
                trainer = gpt_trainer(config, "unused", devices=devs, with_data=False)
            else:
                from jaxmp.topology import gpu_topology, without_persistent_cache

                without_persistent_cache()
                topo = gpu_topology(32, "H100")
                plan = gpt_plan(config, 32, device_kind="H100", platform="cuda",
                                find_devices_needed=False)
                trainer = gpt_trainer(config, devices=list(topo.devices), with_data=False,
                                      plan=plan)
            assert trainer.executed_layout() == trainer.plan.layout
            measured = measure_step(trainer)
            print(_row(label, trainer, measured, time.perf_counter() - start), flush=True)
    return 0
