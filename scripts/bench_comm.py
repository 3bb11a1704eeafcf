"""Bytes each device sends per train step, parsed from the compiled HLO, per mesh.

    python scripts/bench_comm.py            # 8 simulated CPU devices, the test GPT

Prints a Markdown table for docs/benchmarks.md: as compiled (raw) and with all-reduce +
dynamic-slice folded into the reduce-scatter a GPU/TPU pipeline makes of it.
"""
import dataclasses
import os
import sys

from jaxmp._util.env import simulate_devices

simulate_devices(8)
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from helpers import TINY, step_collectives  # noqa: E402

print("| head | mesh | param bytes P | sent (folded) | sent (raw CPU) | folded / ((N-1)/N·P) | by kind (folded) |")
print("|---|---|---:|---:|---:|---:|---|")
for tied in (True, False):
    cfg = dataclasses.replace(TINY, tie_embeddings=tied)
    for axes in [{"data": 8}, {"fsdp": 8}, {"tensor": 8}, {"data": 2, "fsdp": 2, "tensor": 2}]:
        st, p = step_collectives(axes, cfg)
        kinds = ", ".join(f"{k} {v:,.0f}" for k, v in st.bytes_by_kind.items() if v)
        name = "×".join(f"{k}{v}" for k, v in axes.items())
        print(f"| {'tied' if tied else 'untied'} | {name} | {p:,} | {st.total_bytes:,.0f} | "
              f"{st.raw_total_bytes:,.0f} | {st.total_bytes / (7 / 8 * p):.2f} | {kinds} |")
