"""Published training runs as GPT configs: what the planner is checked against at scale.

Each :class:`PublishedRun` is a model, a global batch, a device count and kind, the layout the
run used and its published step time. :func:`evaluate` costs the model (traced with a scanned
stack: seconds, even for 1T parameters), plans it on those devices, and predicts the published
layout with the same planning call, its settings fixed (as ``jaxmp plan --compare`` does).
docs/planner.md's table "published run -> jaxmp's prediction" is ``python scripts/measure.py
published``; the test suite asserts the goals (tests/test_published.py).

The runs were PyTorch programs, whose caching allocator can fill nearly all of a GPU
(torchtitan's 8B row reports 82.4 of 95.6 GiB), so they are judged against 95 % of device
memory rather than JAX's default 75 % preallocation.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from jaxmp.plan import Plan
from jaxmp.recipes.gpt import gpt_plan
from jaxmp.recipes.gpt_config import Config, load_config

_GPT = ("data.source=synthetic", "model.compute_dtype=bfloat16", "model.param_dtype=float32",
        "model.remat=auto")


def _megatron(layers: int, d_model: int, heads: int, batch: int) -> tuple[str, ...]:
    """Megatron-LM's GPT (Narayanan et al., SC'21, Table 1): vocab 51200, sequence 2048."""
    return _GPT + (f"model.layers={layers}", f"model.d_model={d_model}", f"model.heads={heads}",
                   "model.vocab_size=51200", "data.seq_len=2048", f"train.batch_size={batch}")


def megatron_step_s(layers: int, d: int, batch: int, tflops: float, gpus: int,
                    seq: int = 2048, vocab: int = 51200) -> float:
    """Step time from Megatron's reported TFLOP/s per GPU and its FLOP count (recompute
    included): 96·B·s·l·h²·(1 + s/6h + V/16lh)."""
    flops = 96 * batch * seq * layers * d * d * (1 + seq / (6 * d) + vocab / (16 * layers * d))
    return flops / (gpus * tflops * 1e12)


# Megatron-LM's 2021 runs replicated the Adam state over data and kept the residual stream
# whole (its distributed optimizer and sequence parallelism came later): their layouts say so.
# Nor did they have flash attention (fused softmax over materialised scores): XLA's attention.
_MEGATRON_2021 = {"train.optimizer_sharding": "none", "train.sequence_parallel": "false",
                  "model.attention": "xla"}


@dataclass(frozen=True, eq=False)  # hashed by identity: RUNS are constants
class PublishedRun:
    name: str
    source: str
    sets: tuple[str, ...]  # config overrides: the model and the global batch
    device: str  # profile
    devices: int
    # config keys: mesh axes, pipeline schedule, microbatches, remat, and what the run did not
    # have (Megatron's 2021 runs predate sequence parallelism)
    layout: Mapping[str, Any]
    step_time_s: float  # published (derived from throughput where that is what was published)
    published: str  # what the source reports
    usable_fraction: float = 0.95
    xfail_time: str = ""  # why the step time goal is known to miss (empty: it holds)
    notes: tuple[str, ...] = field(default_factory=tuple)
    precision: str = "bf16"  # of the published figure; jaxmp predicts bf16 (see BF16_RATE)
    xfail_fit: str = ""  # why the published layout is known not to fit yet (empty: it fits)
    xfail_choice: str = ""  # why jaxmp's own choice is known to be slower (empty: no slower)


# Precisions whose tensor-core rate on A100 / H100 is bf16's (fp16; "16-bit" where a paper
# does not say which): their step times are judged; FP8 rows only fit.
BF16_RATE = ("bf16", "fp16", "16-bit")

RUNS: tuple[PublishedRun, ...] = (
    PublishedRun(
        "Megatron-LM GPT 1T", "Narayanan et al., SC'21, Table 1 (interleaved schedule, "
        "microbatch 1)", _megatron(128, 25600, 160, 3072), "A100-80GB", 3072,
        {"mesh.data": 6, "mesh.stage": 64, "mesh.tensor": 8,
         "pipeline.schedule": "interleaved", "pipeline.virtual_stages": 2,
         "train.microbatches": 512, "model.remat": "full", **_MEGATRON_2021},
        megatron_step_s(128, 25600, 3072, 163, 3072), "163 TFLOP/s per GPU (52 % of peak)"),
    PublishedRun(
        "Megatron-LM GPT 1.7B", "Narayanan et al., SC'21, Table 1", _megatron(24, 2304, 24, 512),
        "A100-80GB", 32, {"mesh.data": 32, "model.remat": "full", **_MEGATRON_2021},
        megatron_step_s(24, 2304, 512, 137, 32), "137 TFLOP/s per GPU (44 % of peak)",
        notes=("-30 % until stop 27: its memory-bound attention softmax (s/h = 0.9), now "
               "charged at the memory bandwidth (jaxmp.cost.traffic), -14 %",)),
    PublishedRun(
        "Megatron-LM GPT 18.4B", "Narayanan et al., SC'21, Table 1",
        _megatron(40, 6144, 48, 1024), "A100-80GB", 256,
        {"mesh.data": 32, "mesh.tensor": 8, "model.remat": "full", **_MEGATRON_2021},
        megatron_step_s(40, 6144, 1024, 135, 256), "135 TFLOP/s per GPU (43 % of peak)"),
    PublishedRun(
        "torchtitan Llama 3.1 8B", "pytorch/torchtitan docs/performance.md (commit d4c86e3), "
        "Table 1: FSDP + torch.compile, local batch 2, selective AC, bf16", _GPT + (
            "model.layers=32", "model.d_model=4096", "model.heads=32", "model.kv_heads=8",
            "model.mlp_dim=14336", "model.activation=swiglu", "model.tie_embeddings=false",
            "model.vocab_size=128256", "data.seq_len=8192", "train.batch_size=16"),
        "H100-96GB", 8, {"mesh.fsdp": 8, "train.microbatches": 1}, 2 * 8192 / 6667,
        "6,667 tokens/s per GPU (compiled; eager: 5,762)",
        notes=("the compiled row: jaxmp predicts an XLA-compiled step; flash attention both",)),
)

# NeMo's H100 table (NeMo 24.07, FP8): Megatron-Core with its distributed optimizer (Adam state
# and the float32 master sharded over data beside bf16 params: model.param_dtype=bfloat16 with
# train.master_weights' default), sequence parallelism and flash attention (Transformer Engine).
_NEMO = ("NVIDIA NeMo docs/source/performance/performance_summary.md (container 24.07, "
         "DGX-H100, FP8): distributed optimizer, sequence parallel, flash attention")


def _nemo(name: str, model: tuple[str, ...], batch: int, seq: int, gpus: int,
          mesh: tuple[int, int, int], virtual: int, tokens_per_gpu_s: int,
          tflops: int, xfail_fit: str = "", micro: int = 1) -> PublishedRun:
    """A row of NeMo's table: ``mesh`` = (data, stage, tensor), ``micro`` sequences per
    micro-batch."""
    data, stage, tensor = mesh
    schedule = {"pipeline.schedule": "interleaved", "pipeline.virtual_stages": virtual} \
        if stage > 1 else {}
    return PublishedRun(
        name, _NEMO, _GPT + model + (f"data.seq_len={seq}", f"train.batch_size={batch}",
                                     "model.param_dtype=bfloat16"),
        "H100", gpus,
        {"mesh.data": data, "mesh.stage": stage, "mesh.tensor": tensor, **schedule,
         "train.microbatches": batch // (data * micro), "train.optimizer_sharding": "data",
         "train.sequence_parallel": "true" if tensor > 1 else "false"},
        batch * seq / (tokens_per_gpu_s * gpus),
        f"{tokens_per_gpu_s:,} tokens/s per GPU ({tflops} TFLOP/s, FP8)", precision="fp8",
        xfail_fit=xfail_fit)


PUBLISHED_ZERO: tuple[PublishedRun, ...] = (
    _nemo("NeMo GPT-3 175B", ("model.layers=96", "model.d_model=12288", "model.heads=96",
                              "model.vocab_size=50304"), 256, 2048, 128, (4, 8, 4), 6, 726, 782),
    _nemo("NeMo Llama 2 70B", (
        "model.layers=80", "model.d_model=8192", "model.heads=64", "model.kv_heads=8",
        "model.mlp_dim=28672", "model.activation=swiglu", "model.tie_embeddings=false",
        "model.vocab_size=32000"), 128, 4096, 64, (4, 4, 4), 20, 1707, 759),
    _nemo("NeMo Llama 2 13B", (
        "model.layers=40", "model.d_model=5120", "model.heads=40", "model.mlp_dim=13824",
        "model.activation=swiglu", "model.tie_embeddings=false", "model.vocab_size=32000"),
        128, 4096, 16, (4, 4, 1), 10, 8646, 754),
    _nemo("NeMo GPT-3 20B", ("model.layers=44", "model.d_model=6144", "model.heads=48",
                             "model.vocab_size=50304"), 256, 2048, 64, (32, 1, 2), 1, 5851, 750,
          micro=2),  # fits since microbatch gradients are summed inside the backward
)
RUNS = RUNS + PUBLISHED_ZERO

# Published bf16 runs with the memory-saving layouts: Megatron-Core's distributed optimizer,
# sequence parallelism and flash attention; FSDP (MaxText, torchtitan) with flash attention.
_DGXC = "NVIDIA/dgxc-benchmarking"
# Llama 2 70B and Llama 3 70B: one shape (their vocabularies differ)
_LLAMA_70B = ("model.kv_heads=8", "model.mlp_dim=28672", "model.activation=swiglu",
              "model.tie_embeddings=false")


def _shape(layers: int, d_model: int, heads: int, vocab: int, seq: int, batch: int,
           *more: str) -> tuple[str, ...]:
    """A GPT of this shape, sequence length and global batch, with ``more`` model keys."""
    return _GPT + (f"model.layers={layers}", f"model.d_model={d_model}", f"model.heads={heads}",
                   f"model.vocab_size={vocab}", f"data.seq_len={seq}",
                   f"train.batch_size={batch}") + more


PUBLISHED_BF16: tuple[PublishedRun, ...] = (
    PublishedRun(
        "NeMo GPT-3 175B bf16", f"{_DGXC} v25.02.01 nemo_megatron/README_175b.md (NeMo 24.12, "
        "DGX-H100, BF16) with its gpt3_175b_hydra.yaml: distributed_fused_adam, "
        "sequence_parallel, megatron_amp_O2, Transformer Engine, no activation checkpointing",
        _shape(96, 12288, 96, 50304, 2048, 256, "model.param_dtype=bfloat16"), "H100", 128,
        {"mesh.data": 4, "mesh.stage": 8, "mesh.tensor": 4, "pipeline.schedule": "interleaved",
         "pipeline.virtual_stages": 6, "train.microbatches": 64, "model.remat": "none",
         "train.optimizer_sharding": "data", "train.sequence_parallel": "true"},
        8.309, "63,099 tokens/s (53.5 % MFU, BF16)"),
    PublishedRun(
        "NeMo Nemotron-4 15B bf16", f"{_DGXC} v25.01 nemotron/README_15b.md (NeMo 24.11, "
        "DGX-H100, BF16) with its configure.sh and nemotron4-15b-synth.yaml: TP 4, "
        "micro-batch 4, distributed_fused_adam, sequence_parallel, megatron_amp_O2, "
        "Transformer Engine fused attention, no activation checkpointing",
        _shape(32, 6144, 48, 256000, 4096, 64, "model.kv_heads=8", "model.mlp_dim=24576",
               "model.activation=gelu", "model.tie_embeddings=false",
               "model.param_dtype=bfloat16"), "H100", 16,
        {"mesh.data": 4, "mesh.tensor": 4, "train.microbatches": 4, "model.remat": "none",
         "train.optimizer_sharding": "data", "train.sequence_parallel": "true"},
        2.83, "92,630 tokens/s (62.1 % MFU, BF16)",
        notes=("squared-ReLU MLP costed as jaxmp's gelu MLP: the same matmuls",)),
    PublishedRun(
        "BLOOM 176B", "bigscience-workshop/bigscience train/tr11-176B-ml: tr11-176B-ml.slurm "
        "(Megatron-DeepSpeed, TP 4, PP 12, micro-batch 2, --bf16 with its ZeRO-1-equivalent "
        "optimizer, --checkpoint-activations) and chronicles.md's iteration log",
        _shape(70, 14336, 112, 250880, 2048, 2048, "model.param_dtype=bfloat16"),
        "A100-80GB", 384,
        {"mesh.data": 8, "mesh.stage": 12, "mesh.tensor": 4, "pipeline.schedule": "1f1b",
         "train.microbatches": 128, "model.remat": "full",
         **_MEGATRON_2021, "train.optimizer_sharding": "data"},
        105.22, "149.02 TFLOP/s per GPU (bf16; iteration log)",
        notes=("published memory: 'one copy of the model takes 48 GPUs (using 60 GB of memory "
               "on each GPU)' (BigScience's BLOOM model page)", "ALiBi and the embedding "
               "layernorm are not in jaxmp's GPT; neither moves the matmuls")),
    PublishedRun(
        "MaxText Llama 2 70B", f"{_DGXC} v24.11.1 maxtext/README_70b.md and configure.sh "
        "(JAX, FSDP 64, per-device batch 2, remat save_dot_except_mlpwi, cudnn_flash_te, "
        "BF16)", _shape(80, 8192, 64, 32000, 4096, 128, *_LLAMA_70B), "H100", 64,
        {"mesh.fsdp": 64, "train.microbatches": 1, "model.remat": "save_dots_except_mlp_in"},
        6.999, "74,909 tokens/s (52.6 % MFU, BF16)", usable_fraction=0.94),
    PublishedRun(
        "torchtitan Llama 3 70B", "pytorch/torchtitan docs/performance.md (commit 4d88a8a), "
        "Llama 3 on 64 A100-80GB: FSDP, local batch 1, full activation checkpointing, bf16",
        _shape(80, 8192, 64, 128256, 8192, 64, *_LLAMA_70B), "A100-80GB", 64,
        {"mesh.fsdp": 64, "train.microbatches": 1, "model.remat": "full"},
        8192 / 331, "331 tokens/s per GPU (51.7 % MFU)"),
)
RUNS = RUNS + PUBLISHED_BF16

# Runs nobody here had named before stop 34 (errors first reported as predicted, no term of
# the model changed for them; docs/planner.md §6). Korthikanti et al. 2022, "Reducing
# Activation Recomputation in Large Transformer Models", Tables 3 and 5: Megatron-LM GPT (vocab
# 51200, sequence 2048) on A100-80GB, tensor 8, micro-batch 1 (22B: 4), global batch = GPUs
# (22B: 4); sequence parallelism with selective recomputation (the attention core recomputed:
# model.remat = "selective"), beside its full-recompute baseline (no sequence parallelism).
# "16-bit mixed precision" (fp16 or bf16: the A100's peak is the same); the tables do not name
# the pipeline schedule: 1F1B. No distributed optimizer (data = 1 in all four anyway).
_KORTHIKANTI = "Korthikanti et al. 2022 (arXiv 2205.05198), Tables 3 and 5, tensor 8"
_SELECTIVE = {"model.remat": "selective", "model.attention": "xla",
              "train.sequence_parallel": "true", "train.optimizer_sharding": "none"}
# jaxmp's 1F1B runs in lockstep ticks (one forward and one backward a tick): stage 0 holds
# 2(p-1)+1 microbatches' residuals where Megatron's holds p (Schedule.in_flight)
_LOCKSTEP = ("jaxmp's lockstep 1F1B holds 2(p-1)+1 = 127 microbatches' residuals on stage 0 "
             "where Megatron's holds p = 64: {} of 75.3 GiB")


def _korthikanti(size: str, shape: tuple[int, int, int], stages: int, batch: int,
                 step_s: float, published: str, full: bool = False, xfail_fit: str = "",
                 xfail_choice: str = "") -> PublishedRun:
    """A row of Korthikanti et al.'s Table 5: ``shape`` = (layers, d_model, heads); ``full``:
    its full-recompute baseline (Megatron-LM before the paper: no sequence parallelism)."""
    layers, d_model, heads = shape
    pipe = {"mesh.stage": stages, "pipeline.schedule": "1f1b"} if stages > 1 else {}
    how = {"model.remat": "full", **_MEGATRON_2021} if full else _SELECTIVE
    return PublishedRun(
        f"Megatron-LM {'full recompute' if full else 'SP+selective'} {size}", _KORTHIKANTI,
        _megatron(layers, d_model, heads, batch), "A100-80GB", 8 * stages,
        {"mesh.data": 1, "mesh.tensor": 8, **pipe,
         "train.microbatches": batch // (4 if stages == 1 else 1), **how},
        step_s, published, precision="16-bit", xfail_fit=xfail_fit, xfail_choice=xfail_choice)


# size, shape, stages, batch, (selective s, MFU, HFU), full s, known misses (selective's fit,
# full's fit, selective's choice)
_KORTHIKANTI_ROWS = (
    ("22B", (48, 6144, 64), 1, 4, (1.10, 41.5, 43.7), 1.42, ("", "", "")),
    ("175B", (96, 12288, 96), 8, 64, (13.75, 51.4, 52.8), 18.13, ("", "", "")),
    ("530B", (105, 20480, 128), 35, 280, (37.83, 56.0, 57.0), 49.05, ("", "", "")),
    ("1T", (128, 25600, 160), 64, 512, (71.49, 56.3, 57.0), 94.42,
     (_LOCKSTEP.format("79.7"), _LOCKSTEP.format("76.3"), "")),
)
PUBLISHED_UNSEEN: tuple[PublishedRun, ...] = tuple(
    _korthikanti(size, shape, stages, batch, t, f"{t} s per iteration ({mfu} % MFU, "
                 f"{hfu} % HFU)", xfail_fit=why[0], xfail_choice=why[2])
    for size, shape, stages, batch, (t, mfu, hfu), _, why in _KORTHIKANTI_ROWS) + tuple(
    _korthikanti(size, shape, stages, batch, full, f"{full} s per iteration (full recompute)",
                 full=True, xfail_fit=why[1])
    for size, shape, stages, batch, _, full, why in _KORTHIKANTI_ROWS) + (
    # Smith et al. 2022 (arXiv 2201.11990), MT-NLG 530B: Megatron-DeepSpeed, tensor 8 x
    # pipeline 35 per replica, batch 1920 x 2048, activation checkpointing, ZeRO-1-style
    # optimizer sharding over data; on 280 DGX A100 (2240 GPUs, data 8) an iteration takes
    # 60.1 s at 126 TFLOP/s per GPU (Megatron's FLOP count gives 60.0 s from it).
    PublishedRun(
        "MT-NLG 530B", "Smith et al. 2022, MT-NLG (arXiv 2201.11990), system-throughput "
        "table: 280 DGX A100 nodes", _shape(105, 20480, 128, 51200, 2048, 1920),
        "A100-80GB", 2240,
        {"mesh.data": 8, "mesh.stage": 35, "mesh.tensor": 8, "pipeline.schedule": "1f1b",
         "train.microbatches": 240, "model.remat": "full", **_MEGATRON_2021,
         "train.optimizer_sharding": "data"},
        60.1, "60.1 s per iteration (126 TFLOP/s per GPU)", precision="16-bit"),
    PublishedRun(
        "Llama 3 405B", "Llama 3 Herd of Models (Dubey et al. 2024), Table 4: 16,384 H100, TP 8, "
        "CP 1, PP 16, DP 128, sequence 8192, batch 16 per DP group, 400 TFLOP/s per GPU "
        "(41 % BF16 MFU); FSDP-sharded optimizer state, BF16 weights with FP32 master",
        _shape(126, 16384, 128, 128256, 8192, 2048, "model.kv_heads=8",
               "model.mlp_dim=53248", *_LLAMA_70B[2:], "model.param_dtype=bfloat16"),
        "H100", 16384,
        {"mesh.data": 128, "mesh.stage": 16, "mesh.tensor": 8,
         "pipeline.schedule": "interleaved", "pipeline.virtual_stages": 2,
         "train.microbatches": 16, "train.optimizer_sharding": "data",
         "train.sequence_parallel": "true"},
        (6 * 405e9 + 12 * 126 * 16384 * 8192 / 2) * 2048 * 8192 / (16384 * 400e12),
        "400 TFLOP/s per GPU (41 % MFU, BF16)",
        notes=("step time from 6·N FLOPs a token plus causal attention's 12·l·d·s/2 at 400 "
               "TFLOP/s (Meta's exact count is not stated); virtual stages not stated: 2",)),
)
RUNS = RUNS + PUBLISHED_UNSEEN

# The GPT-3 175B check: a plan on 1024 H100s that fits within JAX's default memory.
GPT3_175B = _GPT + ("model.layers=96", "model.d_model=12288", "model.heads=96",
                    "model.vocab_size=50304", "data.seq_len=2048", "train.batch_size=1536")


def run_config(run: PublishedRun, layout: bool = False) -> Config:
    """The run's model and batch as a config; ``layout``: with its published layout fixed."""
    given = [f"{k}={v}" for k, v in run.layout.items()] if layout else []
    return load_config(None, [*run.sets, f"device.usable_fraction={run.usable_fraction}",
                              *given])


@dataclass
class Evaluation:
    run: PublishedRun
    plan: Plan  # what jaxmp chooses on those devices
    given: Plan  # the published layout, as jaxmp predicts it

    @property
    def error(self) -> float:
        return self.given.predicted.step_time_s / self.run.step_time_s - 1


def evaluate(run: PublishedRun) -> Evaluation:
    """Plan ``run``'s model on its devices and predict its published layout, both for GPUs
    (cuDNN's flash attention wherever jaxmp's layout can run it, as the runs had flash
    attention; runs that did not say ``model.attention = "xla"``)."""
    plan = gpt_plan(run_config(run), run.devices, run.device, strict=True, platform="cuda")
    given = gpt_plan(run_config(run, layout=True), run.devices, run.device, strict=True,
                     find_devices_needed=False, platform="cuda")
    return Evaluation(run, plan, given)
