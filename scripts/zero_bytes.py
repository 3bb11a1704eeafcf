"""Per-device argument, temporary and collective bytes with the optimizer state replicated over
data and sharded over it (``train.optimizer_sharding`` none / data), the prediction beside the
compiled number: docs/benchmarks.md §"Optimizer state sharded over data".

    python scripts/zero_bytes.py cpu     # the test GPT on 8 simulated CPU devices
    python scripts/zero_bytes.py gpu     # a 175B-wide slice on 32 deviceless H100s (CUDA plugin)
    python scripts/zero_bytes.py time    # step time on 8 CPU devices, off and on interleaved

The GPU case compiles the Trainer's own step with XLA's GPU compiler for deviceless H100s
(``jaxmp.topology.gpu_topology``); its collective bytes are read from the compiled HLO.
"""

from __future__ import annotations

import os
import sys
import time

CPU_GPT = ["model.layers=2", "model.d_model=64", "model.heads=8", "model.mlp_dim=256",
           "model.vocab_size=256", "model.tie_embeddings=false", "data.seq_len=16",
           "train.batch_size=16", "checkpoint.enabled=false"]
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
           "pipeline.balance=layers", "model.attention=xla"]
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
            "mesh.stage=1"]


def step_times(rounds: int = 7, steps: int = 5) -> int:
    """Seconds per step, off and on, in alternating rounds (A B A B ...): median and range."""
    import statistics

    import jax
    import jaxmp
    from jaxmp.recipes.gpt import gpt_trainer, lm_batches
    from jaxmp.train.state import init_state

    runs = {}
    for zero in ("none", "data"):
        config = jaxmp.load_config(None, TIME_GPT + [f"train.optimizer_sharding={zero}"])
        t = gpt_trainer(config, "unused")
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


def main(where: str) -> int:
    if where == "time":
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   " --xla_force_host_platform_device_count=8")
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        return step_times()
    if where == "cpu":
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   " --xla_force_host_platform_device_count=8")
    else:
        os.environ["JAX_PLATFORMS"] = "cpu"
    import jaxmp
    from jaxmp.recipes.gpt import gpt_plan, gpt_trainer
    from jaxmp.tools.measure import measure_step

    print("| layout | optimizer | argument bytes (predicted) | temporary bytes (predicted) | "
          "collective bytes (predicted) | compile |\n|---|---|---|---|---|---|")
    cases = [(" ".join(s.removeprefix("mesh.") for s in m), CPU_GPT + m) for m in CPU_MESHES] \
        if where == "cpu" else [(k, v) for k, v in GPU_CASES.items() if where in ("gpu", k)]
    for label, base in cases:
        for zero in ("none", "data"):
            sets = base + [f"train.optimizer_sharding={zero}"]
            config = jaxmp.load_config(None, sets)
            start = time.perf_counter()
            if where == "cpu":
                trainer = gpt_trainer(config, "unused", with_data=False)
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


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "cpu"))
