"""Bytes each device sends per train step, parsed from the compiled HLO, per mesh.

    python scripts/bench_comm.py            # 8 simulated CPU devices: the test GPT, then the
                                            # research-style LM of examples/train_research_lm.py

Prints Markdown tables for docs/benchmarks.md: as compiled (raw) and with all-reduce +
dynamic-slice folded into the reduce-scatter a GPU/TPU pipeline makes of it.
"""
import dataclasses
import importlib.util
import os
import sys

from jaxmp._util.env import simulate_devices

simulate_devices(8)
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from helpers import TINY, step_collectives  # noqa: E402
from jaxmp._util.arrays import tree_bytes  # noqa: E402
from jaxmp.hlo import collective_stats  # noqa: E402

MESHES = [{"data": 8}, {"fsdp": 8}, {"tensor": 8}, {"data": 2, "fsdp": 2, "tensor": 2}]


def row(label: str, axes: dict, stats, p: int) -> str:
    kinds = ", ".join(f"{k} {v:,.0f}" for k, v in stats.bytes_by_kind.items() if v)
    name = "×".join(f"{k}{v}" for k, v in axes.items())
    return (f"| {label} | {name} | {p:,} | {stats.total_bytes:,.0f} | "
            f"{stats.raw_total_bytes:,.0f} | {stats.total_bytes / (7 / 8 * p):.2f} | {kinds} |")


def research_lm():
    spec = importlib.util.spec_from_file_location("train_research_lm",
                                                  os.path.join(HERE, "train_research_lm.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_research_lm"] = module
    spec.loader.exec_module(module)
    return module


print("| model | mesh | param bytes P | sent (folded) | sent (raw CPU) | folded / ((N-1)/N·P) "
      "| by kind (folded) |")
print("|---|---|---:|---:|---:|---:|---|")
for tied in (True, False):
    cfg = dataclasses.replace(TINY, tie_embeddings=tied)
    for axes in MESHES:
        st, p = step_collectives(axes, cfg)
        print(row(f"GPT, {'tied' if tied else 'untied'}", axes, st, p))
lm = research_lm()
example = {k: jax.ShapeDtypeStruct((16, 64), np.int32) for k in ("inputs", "targets")}
for axes in MESHES:
    sets = [f"mesh.{a}={axes.get(a, 1)}" for a in ("data", "stage", "fsdp", "tensor")]
    trainer = lm.make_trainer(lm.make_config(1, sets + ["checkpoint.enabled=false"]), "/tmp/x")
    st = collective_stats(trainer.compile(example))
    print(row("research LM", axes, st, tree_bytes(trainer.layout.abstract.params)))
