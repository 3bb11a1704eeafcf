"""Bytes each device sends per train step, per mesh, parsed from the compiled step's HLO.

    python scripts/measure.py comm --simulate-devices 8

The GPT of the test suite (2 layers, d_model 64, 8 heads, vocab 256, MLP 256, float32; global
batch 16 x 16 tokens), tied and untied, then the research-style LM of
examples/train_research_lm.py (global batch 16 x 64): each step is the Trainer's, as
`jaxmp train` compiles it. Prints the Markdown table of docs/benchmarks.md: as compiled (raw)
and with all-reduce + dynamic-slice folded into the reduce-scatter a GPU/TPU pipeline makes of
it, against the parameter bytes P.
"""
from __future__ import annotations

import argparse

from studies.common import by_kind, devices, gpt, mesh_sets, meshes

DOC = "docs/benchmarks.md"
DEVICES = True
GPT = ["model.layers=2", "model.d_model=64", "model.heads=8", "model.mlp_dim=256",
       "model.vocab_size=256", "data.seq_len=16", "train.batch_size=16",
       "checkpoint.enabled=false"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--meshes", default="dp,fsdp,tensor,data=2,fsdp=2,tensor=2",
                   help="meshes as `jaxmp bench --strategies` names them (default %(default)s)")


def row(model: str, mesh: str, stats, params: int, n: int) -> str:
    ideal = (n - 1) / n * params
    return (f"| {model} | {mesh} | {params:,} | {stats.total_bytes:,.0f} | "
            f"{stats.raw_total_bytes:,.0f} | {stats.total_bytes / ideal:.2f} | {by_kind(stats)} |")


def run(args: argparse.Namespace) -> int:
    import jax
    import numpy as np

    from jaxmp._util.arrays import tree_bytes
    from jaxmp.recipes.gpt import gpt_trainer
    from jaxmp.tools.measure import measure_step
    from studies.common import research_lm

    devs = devices(args)
    print("| model | mesh | param bytes P | sent (folded) | sent (raw CPU) | folded / ((N-1)/N·P) "
          "| by kind (folded) |")
    print("|---|---|---:|---:|---:|---:|---|")
    for tied in (True, False):
        for name, axes in meshes(args.meshes, len(devs)):
            config = gpt(GPT + mesh_sets(axes) + [f"model.tie_embeddings={str(tied).lower()}"])
            trainer = gpt_trainer(config, devices=devs, with_data=False)
            stats = measure_step(trainer).collectives
            print(row(f"GPT, {'tied' if tied else 'untied'}", name, stats,
                      tree_bytes(trainer.layout.abstract.params), len(devs)), flush=True)
    lm = research_lm()
    example = {k: jax.ShapeDtypeStruct((16, 64), np.int32) for k in ("inputs", "targets")}
    for name, axes in meshes(args.meshes, len(devs)):
        config = lm.make_config(1, mesh_sets(axes) + ["checkpoint.enabled=false"])
        trainer = lm.make_trainer(config, "unused", devices=devs)
        stats = measure_step(trainer, example).collectives
        print(row("research LM", name, stats, tree_bytes(trainer.layout.abstract.params),
                  len(devs)), flush=True)
    return 0
