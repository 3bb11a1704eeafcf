"""The trainer's config sections: mesh, optimizer, train loop, checkpoints, logging, XLA, device.

These are all a :class:`jaxmp.Trainer` reads, whatever the model; a recipe adds its own sections
(the GPT recipe: ``[model]`` and ``[data]``, :mod:`jaxmp.recipes.gpt_config`) by subclassing
:class:`TrainerConfig`. Stdlib only and jax-free on purpose: the CLI reads ``xla.flags`` from
here and must put them in ``XLA_FLAGS`` before jax is first imported. (No ``from __future__ import
annotations``: the field types are read at run time to check values.)

Each field's meaning is the comment on its line, after the comment lines right above it (if
any): :func:`jaxmp.config.fields.field_docs` reads them, and docs/config.md is generated from
them (``python scripts/docs.py``), so a new key documents itself where it is declared.
"""


import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar, Literal, get_args

from jaxmp.config.fields import ConfigError, Section, bounded, require

# The mesh axes, outermost first; jaxmp.mesh builds every mesh with exactly these.
MESH_AXES: tuple[str, ...] = ("data", "stage", "fsdp", "tensor")
AxisSize = int | Literal["auto"]

# The enumerations, declared once: each module that implements one reads its names from here
# (e.g. ``jaxmp.pipeline.schedule.KINDS = SCHEDULES``), so a config value and the code that
# runs it cannot disagree.
RematPolicy = Literal["none", "selective", "save_dots", "save_dots_except_mlp_in", "full"]
AttentionKind = Literal["xla", "cudnn"]
Schedule = Literal["gpipe", "1f1b", "interleaved"]
Balance = Literal["flops", "layers"]
GradCompression = Literal["none", "bfloat16", "int8", "powersgd"]
WeightGather = Literal["auto", "param", "bfloat16", "int8"]
OptimizerSharding = Literal["auto", "none", "data"]
MasterWeights = Literal["auto", "float32", "none"]
SequenceParallel = bool | Literal["auto"]  # "auto": the planner's (on when tensor > 1 allows)
REMAT_POLICY_NAMES: tuple[str, ...] = get_args(RematPolicy)
ATTENTION_KINDS: tuple[str, ...] = get_args(AttentionKind)
SCHEDULES: tuple[str, ...] = get_args(Schedule)
BALANCES: tuple[str, ...] = get_args(Balance)
GRAD_COMPRESSIONS: tuple[str, ...] = get_args(GradCompression)
WEIGHT_GATHERS: tuple[str, ...] = get_args(WeightGather)
OPTIMIZER_SHARDINGS: tuple[str, ...] = get_args(OptimizerSharding)

# Renamed keys: ``old -> (new, value renames)``. Outside scripts and saved run configs use the
# old names, so they keep working; each use prints one deprecation line naming the new key.
RENAMED: dict[str, tuple[str, dict[str, str]]] = {
    "train.grad_accum": ("train.microbatches", {}),
    "pipeline.microbatches": ("train.microbatches", {}),
    "train.grad_compression": ("compression.gradients", {"bf16": "bfloat16"}),
    "train.error_feedback": ("compression.error_feedback", {}),
    "train.int8_block": ("compression.int8_block", {}),
    "train.powersgd_rank": ("compression.powersgd_rank", {}),
    "train.powersgd_start": ("compression.powersgd_start", {}),
    "train.gather_dtype": ("compression.weights", {}),
}


@dataclass(frozen=True)
class MeshConfig(Section):
    """Mesh axis sizes: an int (fixed: a constraint of the plan), -1 (fill what the other axes
    leave; the mesh is then spelled out and "auto" axes are 1) or "auto" (the planner decides,
    given the model's costs; without them 1, and all "auto" is data parallel). See
    :func:`jaxmp.plan.make_plan`."""

    section: ClassVar[str] = "mesh"
    data: AxisSize = "auto"  # replicas, each on its own slice of the batch
    stage: AxisSize = "auto"  # pipeline stages: the layers split in groups (docs/pipeline.md)
    # parameters, gradients and optimizer state sharded, weights gathered per layer (ZeRO-3);
    # it also splits the batch
    fsdp: AxisSize = "auto"
    tensor: AxisSize = "auto"  # each layer's matmuls split (Megatron-style; the fastest links)

    def _validate(self) -> None:
        for axis, size in self.explicit().items():
            require(size >= 1 or size == -1, f"mesh.{axis}",
                     "must be >= 1, -1 (fill the rest) or 'auto'", size)
        fills = [f"mesh.{a}" for a, s in self.explicit().items() if s == -1]
        if len(fills) > 1:
            raise ConfigError(f"{fills[-1]}: only one mesh axis may be -1, "
                              f"but {' and '.join(fills)} are")

    @property
    def is_auto(self) -> bool:
        """True when every axis is "auto": the planner chooses the whole factorisation."""
        return not self.explicit()

    def explicit(self) -> dict[str, int]:
        """Only the axes the user fixed (the planner's constraints)."""
        return {a: getattr(self, a) for a in MESH_AXES if getattr(self, a) != "auto"}

    def sizes(self) -> dict[str, int]:
        """All four axes as ints for ``jaxmp.make_mesh`` (which checks the device count).

        The mesh without a planner: "auto" axes are 1, and all "auto" is data parallelism
        (``{"data": -1, rest: 1}``).
        """
        if self.is_auto:
            return {"data": -1, "stage": 1, "fsdp": 1, "tensor": 1}
        return {a: 1 if getattr(self, a) == "auto" else getattr(self, a) for a in MESH_AXES}


@dataclass(frozen=True)
class OptimizerConfig(Section):
    """AdamW, linear warmup then cosine decay to ``lr * min_lr_ratio``, global-norm clipping."""

    section: ClassVar[str] = "optimizer"
    lr: float = bounded(3e-3, gt=0)  # peak learning rate, reached after warmup_steps
    min_lr_ratio: float = bounded(0.1, ge=0, le=1)  # the cosine decay ends at lr * min_lr_ratio
    warmup_steps: int = bounded(20, ge=0)  # linear warmup from 0 to lr
    weight_decay: float = bounded(0.1, ge=0)  # AdamW's decoupled decay, on arrays of 2+ dims
    beta1: float = bounded(0.9, ge=0, lt=1)  # Adam's first-moment decay
    beta2: float = bounded(0.95, ge=0, lt=1)  # Adam's second-moment decay
    eps: float = bounded(1e-8, gt=0)  # Adam's denominator epsilon
    clip_norm: float = bounded(1.0, ge=0)  # global gradient-norm clipping; 0 = off


@dataclass(frozen=True)
class TrainConfig(Section):
    """Loop length, batch and evaluation. A step with a non-finite loss or gradient changes
    nothing (it is skipped and counted); max_skipped in a row stop the run (exit 1), see
    :mod:`jaxmp.train.guard`."""

    section: ClassVar[str] = "train"
    steps: int = bounded(200, ge=1)  # optimizer steps of the run (a resumed run counts on)
    batch_size: int = bounded(16, ge=1)  # global, in sequences (all devices and processes)
    seed: int = bounded(0, ge=0)  # parameters, data order and per-step randomness
    # pieces one step's batch is cut into: accumulated gradients without pipeline stages, the
    # pipeline's microbatches with them; "auto": the plan's choice (without costs to plan
    # from: 2 x the stages with a pipeline, else 1)
    microbatches: int | Literal["auto"] = "auto"
    eval_every: int = bounded(100, ge=0)  # steps between evaluations; 0 = no evaluation
    eval_batches: int = bounded(4, ge=1)  # batches of held-out data per evaluation
    max_skipped: int = bounded(5, ge=1)  # consecutive non-finite steps skipped before stopping
    # Adam state sharded over data too (ZeRO-1, jaxmp.train.zero); "auto": when it makes a fit
    optimizer_sharding: OptimizerSharding = "auto"
    # norms, residual adds and dropout sharded along the sequence over tensor (sequence
    # parallelism, jaxmp.sharding.sequence); "auto": the planner tries it where tensor > 1
    # splits the sequence and every block matrix, and keeps it when it pays (plan/sequence.py)
    sequence_parallel: SequenceParallel = "auto"
    # a float32 master copy of 16-bit params (model.param_dtype=bfloat16), updated by the
    # optimizer and sharded like its moments (jaxmp.train.master); "auto": float32 whenever
    # the params are narrower than float32; "none": the optimizer updates the 16-bit params
    master_weights: MasterWeights = "auto"

    def _validate(self) -> None:
        m = self.microbatches
        require(m == "auto" or m >= 1, "train.microbatches", "must be >= 1 or 'auto'", m)
        require(m == "auto" or self.batch_size % m == 0, "train.batch_size",
                f"must be divisible by train.microbatches={m}", self.batch_size)


@dataclass(frozen=True)
class CompressionConfig(Section):
    """Bytes on the wire (docs/compression.md): the encoding of the data-axis gradient reduction
    (``gradients``) and the dtype fsdp gathers weights in (``weights``; "auto": the model's
    compute dtype, where the recipe says what it is; "param": the stored dtype)."""

    section: ClassVar[str] = "compression"
    gradients: GradCompression = "none"  # the encoding of the data-axis gradient reduction
    error_feedback: bool = True  # int8 / powersgd: carry what compression dropped to next step
    int8_block: int = bounded(256, ge=8)  # values per int8 scale
    powersgd_rank: int = bounded(4, ge=1)  # rank of PowerSGD's sketch
    powersgd_start: int = bounded(10, ge=0)  # steps reduced uncompressed before PowerSGD starts
    # fsdp weight gathers: "auto" = the model's compute dtype, "param" = as stored
    weights: WeightGather = "auto"


@dataclass(frozen=True)
class CheckpointConfig(Section):
    """Sharded checkpoints in the run directory's ``checkpoints/``; rerunning the same command
    resumes from the latest complete one (docs/reliability.md)."""

    section: ClassVar[str] = "checkpoint"
    every: int = bounded(100, ge=0)  # steps between saves; 0 = only at the end
    keep: int = bounded(3, ge=1)  # the latest checkpoints kept
    keep_period: int = bounded(0, ge=0)  # K > 0 also keeps every K-th step for good
    async_save: bool = True  # write in the background; the loop waits only for the device copy
    enabled: bool = True  # false: no checkpoints (and no resume)


@dataclass(frozen=True)
class LoggingConfig(Section):
    """What a run reports: ``metrics.jsonl``, TensorBoard, the progress bar, profiler traces."""

    section: ClassVar[str] = "logging"
    every: int = bounded(10, ge=1)  # steps between metrics lines (metrics.jsonl, TensorBoard)
    profile_steps: tuple[int, ...] = ()  # [start, stop): write a jax.profiler trace of them
    progress: bool = True  # the progress bar (plain lines when not a terminal)
    tensorboard: bool = True  # event files in the run directory's tensorboard/

    def _validate(self) -> None:
        ps = self.profile_steps
        require(not ps or (len(ps) == 2 and 0 <= ps[0] < ps[1]), "logging.profile_steps",
                 "must be [] or [start, stop] with 0 <= start < stop", ps)


@dataclass(frozen=True)
class XlaConfig(Section):
    """XLA's and jax's own settings, applied before the first step is compiled."""

    section: ClassVar[str] = "xla"
    flags: str = ""  # appended to XLA_FLAGS before jax starts
    matmul_precision: Literal["default", "high", "highest", "bfloat16", "tensorfloat32",
                              "float32"] = "default"  # jax's default matmul precision

    def _validate(self) -> None:
        for flag in self.flags.split():
            require(flag.startswith("--"), "xla.flags", "every flag must start with '--'", flag)


@dataclass(frozen=True)
class DeviceConfig(Section):
    """Device profile for MFU and the planner; 0 keeps the detected profile's value."""

    section: ClassVar[str] = "device"
    # "auto" (detect), or a profile name: A100-40GB, A100-80GB, H100, H100-96GB, H200, CPU
    kind: str = "auto"
    peak_flops: float = bounded(0.0, ge=0)  # FLOP/s per device (dense bf16)
    memory_bytes: float = bounded(0.0, ge=0)  # device memory in bytes
    intra_host_bw: float = bounded(0.0, ge=0)  # bytes/s per device inside a host
    inter_host_bw: float = bounded(0.0, ge=0)  # bytes/s per device across hosts
    devices_per_host: int = bounded(0, ge=0)  # devices sharing the fast intra-host links
    usable_fraction: float = bounded(0.0, ge=0, le=1)  # of memory_bytes the planner may fill
    # achievable fraction of peak_flops; set, it times all compute (no matmul-width curve)
    efficiency: float = bounded(0.0, ge=0, le=1)
    # memory (HBM) bandwidth in bytes/s: the time model's memory-bound work (GPUs' datasheet)
    memory_bw: float = bounded(0.0, ge=0)


@dataclass(frozen=True)
class PipelineConfig(Section):
    """Pipeline parallelism, used when ``mesh.stage`` > 1 (see docs/pipeline.md); the
    microbatches are ``train.microbatches``."""

    section: ClassVar[str] = "pipeline"
    # the order microbatches go through the stages; "auto": the plan's (without costs to plan
    # from: 1f1b)
    schedule: Literal["auto", Schedule] = "auto"
    # chunks per device (interleaved: >= 2); "auto": the plan's (without costs: 1, 2 for
    # interleaved)
    virtual_stages: int | Literal["auto"] = "auto"
    balance: Balance = "flops"  # stage boundaries by per-layer FLOPs, or equal layer counts

    def _validate(self) -> None:
        require(self.virtual_stages == "auto" or self.virtual_stages >= 1,
                "pipeline.virtual_stages", "must be >= 1 or 'auto'", self.virtual_stages)


@dataclass(frozen=True)
class TrainerConfig:
    """Every section the generic trainer reads; one frozen dataclass per TOML section.

    Subclass it to add a model's own sections (each a :class:`~jaxmp.config.fields.Section`);
    :func:`jaxmp.config.load` then accepts their keys too.
    """

    mesh: MeshConfig = field(default_factory=MeshConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    xla: XlaConfig = field(default_factory=XlaConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    compression: CompressionConfig = field(default_factory=CompressionConfig)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            section = getattr(self, f.name)
            require(isinstance(section, section_types(type(self))[f.name]), f.name,
                    "expected a config section", section)
        self._validate()

    def _validate(self) -> None:
        """Constraints between sections (a subclass adds its own)."""


def section_types(schema: type) -> dict[str, type]:
    """``{section name: Section class}`` of a config schema (a TrainerConfig subclass)."""
    return {f.name: f.default_factory for f in dataclasses.fields(schema)}  # type: ignore[misc]
