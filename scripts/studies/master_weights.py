"""Bytes per device with float32 params and with bf16 params beside a float32 master.

    python scripts/measure.py master-weights cpu --simulate-devices 8
    python scripts/measure.py master-weights gpu    # 8 deviceless H100s (CUDA plugin)

The test GPT (docs/benchmarks.md's optimizer-sharding rows) as float32 params with the Adam
moments sharded over data, and as ``model.param_dtype=bfloat16`` with ``train.master_weights``'
default (a float32 master beside the moments, jaxmp/train/master.py) with the optimizer state
sharded over data or not, and without a master (``train.master_weights=none``): per-device
argument, temporary and collective bytes of the compiled step beside the planner's prediction.
``gpu`` compiles with XLA's GPU compiler for 8 deviceless H100s
(``jaxmp.topology.gpu_topology``; ``jaxmp plan --verify --aot`` compiles the same way);
XLA's CPU backend widens 16-bit collectives to float32, so only ``gpu`` shows the 16-bit wire.
``--live DIR`` dumps each compiled step into DIR and adds the bytes live at the heap's peak
(:func:`jaxmp.hlo.heap.live_peak`: what the planner models, before XLA packs the heap).
"""

from __future__ import annotations

import argparse
import os

from studies.common import add_cpu_or_gpu, eight_devices

DOC = "docs/benchmarks.md"
DEVICES = True  # cpu runs on 8 of them; gpu compiles for 8 deviceless H100s instead

GPT = ["model.layers=2", "model.d_model=64", "model.heads=8", "model.mlp_dim=256",
       "model.vocab_size=256", "model.tie_embeddings=false", "data.seq_len=16",
       "train.batch_size=16", "checkpoint.enabled=false", "train.sequence_parallel=false",
       "model.compute_dtype=bfloat16"]
MESHES = [["mesh.data=8"], ["mesh.data=4", "mesh.tensor=2"],
          ["mesh.data=8", "train.microbatches=2"]]
VARIANTS = {"float32 params": ["model.param_dtype=float32", "train.optimizer_sharding=data"],
            "bf16 + master": ["model.param_dtype=bfloat16", "train.optimizer_sharding=data"],
            "bf16 + master, optimizer none": ["model.param_dtype=bfloat16",
                                              "train.optimizer_sharding=none"],
            # 16-bit Adam: the microbatches' running sum is float32 all the same (jaxmp.gradsum)
            "bf16, no master": ["model.param_dtype=bfloat16", "train.master_weights=none",
                                "train.optimizer_sharding=data"]}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_cpu_or_gpu(p, "cpu")
    p.add_argument("--live", metavar="DIR", default=None,
                   help="dump each compiled step into DIR and add the bytes live at its peak")


def run(args: argparse.Namespace) -> int:
    if args.live:  # read when the backend starts: before eight_devices
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={args.live}"
                                   " --xla_dump_hlo_as_proto --xla_dump_hlo_module_re=.*jit_step.*")
    devs = eight_devices(args)
    gpu = args.part == "gpu"
    import jaxmp
    from jaxmp._util.fmt import fmt_bytes
    from jaxmp.hlo.heap import live_peak, newest_dump
    from jaxmp.recipes.gpt import gpt_plan, gpt_trainer
    from jaxmp.tools.measure import measure_step

    live = " live at the peak |" if args.live else ""
    print("| layout | params | argument bytes (predicted) | temporary bytes (predicted) | "
          f"collective bytes (predicted) |{live}\n|---|---|---|---|---|{'---|' * bool(live)}")
    for mesh in MESHES:
        label = " ".join(s.removeprefix("mesh.") for s in mesh)
        for name, sets in VARIANTS.items():
            config = jaxmp.load_config(None, GPT + mesh + sets)
            plan = gpt_plan(config, 8, device_kind="H100", platform="cuda",
                            find_devices_needed=False) if gpu else None
            t = gpt_trainer(config, "unused", devices=devs, with_data=False, plan=plan)
            assert t.executed_layout() == t.plan.layout
            m, p = measure_step(t), t.plan.predicted
            peak = f" {fmt_bytes(live_peak(newest_dump(args.live)).bytes)} |" if live else ""
            print(f"| {label} | {name} | {fmt_bytes(m.argument_bytes)} "
                  f"({fmt_bytes(p.argument_bytes)}) | {fmt_bytes(m.temp_bytes)} "
                  f"({fmt_bytes(p.per_device_bytes - p.argument_bytes)}) | "
                  f"{fmt_bytes(m.collective_bytes)} ({fmt_bytes(p.comm_bytes_per_step)}) |{peak}",
                  flush=True)
    return 0
