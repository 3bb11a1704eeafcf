"""Bytes each device sends per train step with each gradient compression, from the compiled HLO.

    python scripts/bench_compression.py     # 8 simulated CPU devices, the test GPT (untied)

Prints the Markdown tables of docs/compression.md: (1) per mesh and compression, the bytes of
the compiled step (all-reduce + dynamic-slice folded into reduce-scatter, as in
docs/benchmarks.md) and their ratio to uncompressed float32, plus gradient accumulation;
(2) fsdp weight all-gathers by model compute dtype and ``train.gather_dtype``, read from the
program as partitioned (``jaxmp.hlo.partitioned_text``: the CPU backend widens bf16
collectives to float32 afterwards, GPUs keep them).
"""
from jaxmp._util.env import simulate_devices

simulate_devices(8)

import jaxmp  # noqa: E402
from jaxmp.hlo import collective_stats, partitioned_text  # noqa: E402
from jaxmp.recipes.gpt import gpt_trainer  # noqa: E402
from jaxmp.train.step import make_train_step  # noqa: E402

GPT = ["model.layers=2", "model.d_model=64", "model.heads=8", "model.mlp_dim=256",
       "model.vocab_size=256", "model.tie_embeddings=false", "data.seq_len=16",
       "train.batch_size=32", "checkpoint.enabled=false"]
MESHES = [{"data": 8}, {"data": 4, "fsdp": 2}, {"data": 2, "fsdp": 2, "tensor": 2}]
KINDS = [("none", []), ("bf16", ["compression.gradients=bfloat16"]),
         ("int8", ["compression.gradients=int8"]),
         ("powersgd r4", ["compression.gradients=powersgd", "compression.powersgd_rank=4"]),
         ("none, grad_accum 4 (one reduction)", ["train.microbatches=4"])]


def trainer(sets):
    return gpt_trainer(jaxmp.load_config(None, GPT + sets), "unused", with_data=False)


def mesh_sets(axes):
    return [f"mesh.{a}={axes.get(a, 1)}" for a in ("data", "stage", "fsdp", "tensor")]


def kinds(stats):
    return ", ".join(f"{k} {v:,.0f}" for k, v in stats.bytes_by_kind.items() if v)


print("| mesh | compression | sent / device / step | vs none | by kind |")
print("|---|---|---:|---:|---|")
for axes in MESHES:
    name = "×".join(f"{k}{v}" for k, v in axes.items())
    base = None
    for label, sets in KINDS:
        t = trainer(mesh_sets(axes) + sets)
        stats = collective_stats(t.compile())
        base = base or stats.total_bytes
        print(f"| {name} | {label} | {stats.total_bytes:,.0f} | {stats.total_bytes / base:.3f} "
              f"| {kinds(stats)} |")
    # What grad_accum=4 sent before: XLA reduced every microbatch's gradients in the loop.
    old = make_train_step(t.layout, t.loss_fn, t.tx, t.lr_schedule, t.example_batch, 4,
                          t.rules, 0).lower(t.layout.abstract, t.example_batch).compile()
    stats = collective_stats(old)
    print(f"| {name} | none, grad_accum 4, XLA's reductions (before) | {stats.total_bytes:,.0f} "
          f"| {stats.total_bytes / base:.3f} | {kinds(stats)} |")

print()
print("| fsdp8 weights | all-gather bytes (as partitioned) | vs float32 model |")
print("|---|---:|---:|")
base = None
for label, sets in [("float32 model", []),
                    ("bfloat16 model, gather_dtype=param", ["model.compute_dtype=bfloat16",
                                                            "compression.weights=param"]),
                    ("bfloat16 model, gather_dtype=auto (bf16)", ["model.compute_dtype=bfloat16"]),
                    ("bfloat16 model, gather_dtype=int8", ["model.compute_dtype=bfloat16",
                                                           "compression.weights=int8"])]:
    t = trainer(mesh_sets({"fsdp": 8}) + sets)
    step = make_train_step(t.layout, t.loss_fn, t.tx, t.lr_schedule, t.example_batch, 1, t.rules,
                           0, gather=t.gather)
    text = partitioned_text(step.lower(t.layout.abstract, t.example_batch))
    gathered = collective_stats(text).bytes_by_kind["all-gather"]
    base = base or gathered
    print(f"| {label} | {gathered:,.0f} | {gathered / base:.3f} |")
