"""Microbatch gradients summed inside the backward pass vs after it (jaxmp/gradsum.py).

    python scripts/measure.py sum-in-backward gpu    # 8 deviceless H100s (CUDA plugin)
    python scripts/measure.py sum-in-backward cpu --simulate-devices 8
    python scripts/measure.py sum-in-backward time --simulate-devices 8   # step-time ratios

A 4-layer, 512-wide GPT (12.8 M params) with bf16 params beside a float32 master, the optimizer
sharded over data and 4 microbatches: the compiled step with ``Trainer.sum_in_backward`` off
(the plain ``lax.scan`` accumulation: each microbatch's whole gradient beside the float32
running sum) and on (each layer's gradient added into the sum as the backward produces it) —
per-device temporary and collective bytes beside the planner's prediction (which follows
what is built: with microbatches, "on").
"""

from __future__ import annotations

import argparse

from studies.common import add_cpu_or_gpu, eight_devices

DOC = "docs/benchmarks.md"
DEVICES = True

GPT = ["model.layers=4", "model.d_model=512", "model.heads=8", "model.head_dim=64",
       "model.kv_heads=8", "model.mlp_dim=2048", "model.vocab_size=256",
       "model.tie_embeddings=false", "data.seq_len=16", "train.batch_size=32",
       "checkpoint.enabled=false", "train.sequence_parallel=false",
       "model.compute_dtype=bfloat16", "model.param_dtype=bfloat16", "train.microbatches=4",
       "train.optimizer_sharding=data"]
ROWS = [["mesh.data=8", "model.remat=save_dots"],
        ["mesh.data=4", "mesh.tensor=2", "mesh.fsdp=1", "model.remat=save_dots"],
        ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "model.remat=save_dots"],
        ["mesh.data=8", "model.remat=none"]]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("part", nargs="?", default="gpu", choices=["cpu", "gpu", "time"],
                   help="gpu: 8 deviceless H100s; cpu: 8 devices; time: step-time ratios "
                        "on vs off on 8 devices, interleaved (default %(default)s)")
    p.add_argument("--rounds", type=int, default=7, help="A B rounds (time)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per run (time)")


TIMED = ["model.layers=2", "model.d_model=256", "model.heads=4", "model.head_dim=64",
         "model.kv_heads=4", "model.mlp_dim=1024", "model.vocab_size=256",
         "model.tie_embeddings=false", "data.seq_len=64", "train.batch_size=32",
         "checkpoint.enabled=false", "model.param_dtype=bfloat16", "mesh.data=4",
         "mesh.tensor=2", "mesh.fsdp=1", "mesh.stage=1", "train.optimizer_sharding=data"]


def _ratios(args: argparse.Namespace, devs: list, a: tuple, b: tuple) -> str:
    """Median and spread of b/a step-time ratios, runs interleaved A B A B (one invocation)."""
    import statistics

    from jaxmp.tools.bench import random_batch, time_steps
    from jaxmp.train.state import init_state
    from jaxmp.train.step import batch_spec
    from jaxmp.data.batches import to_global

    runs = []
    for trainer, on in (a, b):
        trainer.sum_in_backward = on
        batch = random_batch(trainer.example_batch)
        spec = batch_spec(trainer.mesh, trainer.rules, next(iter(batch.values())).shape[0])
        state = init_state(trainer.layout, trainer.model_fn, trainer.tx, 0)
        runs.append([trainer.compile(), state, to_global(batch, trainer.mesh, spec)])
    ratios = []
    for _ in range(args.rounds):
        medians = []
        for run in runs:
            times, _, run[1] = time_steps(run[0], run[1], run[2], args.steps, 1)
            medians.append(statistics.median(times))
        ratios.append(medians[1] / medians[0])
    ratios.sort()
    return (f"{statistics.median(ratios):.3f} (min {ratios[0]:.3f}, max {ratios[-1]:.3f}, "
            f"{args.rounds} rounds of {args.steps} steps)")


def run(args: argparse.Namespace) -> int:
    if args.part == "time":
        import jaxmp
        from jaxmp.recipes.gpt import gpt_trainer

        devs = eight_devices(argparse.Namespace(**{**vars(args), "part": "cpu"}))
        make = lambda *sets: gpt_trainer(jaxmp.load_config(None, TIMED + list(sets)),  # noqa: E731
                                         "unused", devices=devs, with_data=False)
        acc = make("train.microbatches=4")
        print("sum inside the backward on / off (4 microbatches):",
              _ratios(args, devs, (acc, False), (acc, True)), flush=True)
        print("float32 master on / off (bf16 params, 1 microbatch):",
              _ratios(args, devs, (make("train.master_weights=none"), False),
                      (make("train.master_weights=float32"), False)), flush=True)
        return 0
    devs = eight_devices(args)
    gpu = args.part == "gpu"
    import jaxmp
    from jaxmp._util.fmt import fmt_bytes
    from jaxmp.recipes.gpt import gpt_plan, gpt_trainer
    from jaxmp.tools.measure import measure_step

    print("| layout | temporary bytes, off | on | predicted | collective bytes, off | on |"
          "\n|---|---|---|---|---|---|")
    for row in ROWS:
        config = jaxmp.load_config(None, GPT + row)
        plan = gpt_plan(config, 8, device_kind="H100", platform="cuda",
                        find_devices_needed=False) if gpu else None
        t = gpt_trainer(config, "unused", devices=devs, with_data=False, plan=plan)
        measured = []
        for on in (False, True):
            t.sum_in_backward = on
            measured.append(measure_step(t))
        p = t.plan.predicted
        off, on = measured
        label = " ".join(s.removeprefix("mesh.").removeprefix("model.") for s in row)
        print(f"| {label} | {fmt_bytes(off.temp_bytes)} | {fmt_bytes(on.temp_bytes)} | "
              f"{fmt_bytes(p.per_device_bytes - p.argument_bytes)} | "
              f"{fmt_bytes(off.collective_bytes)} | {fmt_bytes(on.collective_bytes)} |",
              flush=True)
    return 0
