"""Bytes each device sends per train step with each gradient compression and weight gather.

    python scripts/measure.py compression --simulate-devices 8

The test GPT of docs/benchmarks.md (untied), global batch 32 x 16. Prints the two Markdown
tables of docs/compression.md: (1) per mesh and ``compression.gradients``, the bytes of the
compiled step (all-reduce + dynamic-slice folded into reduce-scatter) and their ratio to
uncompressed float32, plus ``train.microbatches=4`` — and, for comparison, the same step with
XLA doing the reductions inside the microbatch loop, as before jaxmp reduced once per step;
(2) fsdp weight all-gathers by model compute dtype and ``compression.weights``, read from the
program as partitioned (``jaxmp.hlo.partitioned_text``: the CPU backend widens bf16
collectives to float32 afterwards, GPUs keep them).
"""
from __future__ import annotations

import argparse

from studies.common import by_kind, devices, gpt, mesh_sets, meshes

DOC = "docs/compression.md"
DEVICES = True
GPT = ["model.layers=2", "model.d_model=64", "model.heads=8", "model.mlp_dim=256",
       "model.vocab_size=256", "model.tie_embeddings=false", "data.seq_len=16",
       "train.batch_size=32", "checkpoint.enabled=false"]
KINDS = [("none", []), ("bf16", ["compression.gradients=bfloat16"]),
         ("int8", ["compression.gradients=int8"]),
         ("powersgd r4", ["compression.gradients=powersgd", "compression.powersgd_rank=4"]),
         ("none, microbatches 4 (one reduction)", ["train.microbatches=4"])]
GATHERS = [("float32 model", []),
           ("bfloat16 model, weights=param", ["model.compute_dtype=bfloat16",
                                              "compression.weights=param"]),
           ("bfloat16 model, weights=auto (bf16)", ["model.compute_dtype=bfloat16"]),
           ("bfloat16 model, weights=int8", ["model.compute_dtype=bfloat16",
                                             "compression.weights=int8"])]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--meshes", default="dp,data=4,fsdp=2,data=2,fsdp=2,tensor=2",
                   help="meshes as `jaxmp bench --strategies` names them (default %(default)s)")


def run(args: argparse.Namespace) -> int:
    from jaxmp.hlo import collective_stats, partitioned_text
    from jaxmp.recipes.gpt import gpt_trainer
    from jaxmp.tools.measure import measure_step
    from jaxmp.train.step import make_train_step

    devs = devices(args)

    def trainer(sets):
        return gpt_trainer(gpt(GPT + sets), "unused", devices=devs, with_data=False)

    print("| mesh | compression | sent / device / step | vs none | by kind |")
    print("|---|---|---:|---:|---|")
    for name, axes in meshes(args.meshes, len(devs)):
        base = None
        for label, sets in KINDS:
            t = trainer(mesh_sets(axes) + sets)
            stats = measure_step(t).collectives
            base = base or stats.total_bytes
            print(f"| {name} | {label} | {stats.total_bytes:,.0f} | "
                  f"{stats.total_bytes / base:.3f} | {by_kind(stats)} |", flush=True)
        # The step before jaxmp reduced once per step: XLA reduced every microbatch in the loop.
        old = make_train_step(t.layout, t.loss_fn, t.tx, t.lr_schedule, t.example_batch, 4,
                              t.rules, 0).lower(t.layout.abstract, t.example_batch).compile()
        stats = collective_stats(old)
        print(f"| {name} | none, microbatches 4, XLA's reductions (before) | "
              f"{stats.total_bytes:,.0f} | {stats.total_bytes / base:.3f} | {by_kind(stats)} |")

    print()
    print("| fsdp8 weights | all-gather bytes (as partitioned) | vs float32 model |")
    print("|---|---:|---:|")
    base = None
    for label, sets in GATHERS:
        t = trainer(mesh_sets({"fsdp": len(devs)}) + sets)
        step = make_train_step(t.layout, t.loss_fn, t.tx, t.lr_schedule, t.example_batch, 1,
                               t.rules, 0, gather=t.gather)
        text = partitioned_text(step.lower(t.layout.abstract, t.example_batch))
        gathered = collective_stats(text).bytes_by_kind["all-gather"]
        base = base or gathered
        print(f"| {label} | {gathered:,.0f} | {gathered / base:.3f} |", flush=True)
    return 0
