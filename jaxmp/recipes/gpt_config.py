"""The GPT recipe's config: its ``[model]`` and ``[data]`` sections on top of the trainer's.

``jaxmp.load_config`` (and ``jaxmp train``) load this schema; the defaults *are*
``configs/tiny.toml`` (tested). Stdlib only, like :mod:`jaxmp.config`: the CLI loads a config
before jax may be imported. (No ``from __future__ import annotations``: field types are read at
run time.) Each field's meaning is the comment on its line and the comment lines right above
it, as in :mod:`jaxmp.config.sections`: docs/config.md is generated from them.
"""

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Literal

from jaxmp.config import Section, TrainerConfig, bounded, load, require
from jaxmp.config.sections import AttentionKind, RematPolicy

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


@dataclass(frozen=True)
class ModelConfig(Section):
    """Decoder-only transformer shape; 0 in kv_heads / head_dim / mlp_dim means "derive it",
    0 in vocab_size "from the data" (see :func:`jaxmp.recipes.gpt.resolve_data`)."""

    section: ClassVar[str] = "model"
    layers: int = bounded(4, ge=1)  # transformer blocks
    d_model: int = bounded(128, ge=1)  # width of the residual stream
    heads: int = bounded(4, ge=1)  # attention (query) heads
    kv_heads: int = bounded(0, ge=0)  # key/value heads; fewer than heads = grouped-query; 0 = heads
    head_dim: int = bounded(0, ge=0)  # 0 = d_model / heads
    # hidden MLP width; 0 = 4 * d_model (gelu) or 8/3 * d_model rounded up to 64 (swiglu)
    mlp_dim: int = bounded(0, ge=0)
    # 0 = from the data: 256 (bytes) for stdlib, synthetic and .bin; a prepared folder's
    # tokenizer size rounded up to a multiple of 64
    vocab_size: int = bounded(0, ge=0)
    activation: Literal["gelu", "swiglu"] = "gelu"  # the MLP's (swiglu: Llama's gated MLP)
    tie_embeddings: bool = True  # the output head reuses the token embedding
    scan_layers: bool = True  # one compiled block body under lax.scan (fast compiles)
    # what the backward pass recomputes instead of storing (selective: only XLA attention's
    # S x S scores, as Megatron's selective recomputation; save_dots: keep the matmul
    # outputs; save_dots_except_mlp_in: those but the MLP's wide inputs, as MaxText's
    # save_dot_except_mlpwi; full: keep the layer inputs only); "auto": the plan's choice
    remat: Literal["auto", RematPolicy] = "none"
    # "auto": cuDNN's flash attention where it runs (jaxmp.models.attention), else XLA's
    attention: Literal["auto", AttentionKind] = "auto"
    compute_dtype: Literal["float32", "bfloat16"] = "float32"  # matmuls and activations
    param_dtype: Literal["float32", "bfloat16"] = "float32"  # stored parameters (master weights)
    norm_eps: float = bounded(1e-5, gt=0)  # RMSNorm's epsilon
    init_std: float = bounded(0.02, gt=0)  # standard deviation of the initial weights
    rope_theta: float = bounded(10000.0, gt=1)  # rotary embedding base (Llama 3: 500000.0)
    # "llama3": Llama 3.1's long-context frequency rescaling (the rope_* keys below)
    rope_scaling: Literal["none", "llama3"] = "none"
    rope_factor: float = bounded(8.0, ge=1)  # llama3: long wavelengths slowed by this factor
    rope_low_freq_factor: float = bounded(1.0, gt=0)  # llama3: original_max / this = long end
    rope_high_freq_factor: float = bounded(4.0, gt=0)  # llama3: original_max / this = short end
    rope_original_max_positions: int = bounded(8192, ge=1)  # llama3: the pre-training context
    qkv_bias: bool = False  # biases on the q/k/v projections (Qwen2)
    # under sequence parallelism, the tensor-parallel projections as ring collective matmuls
    # (jaxmp.sharding.ring: each neighbour send beside a block's matmul); "auto": on GPU meshes,
    # outside pipeline stages. Off by default: at gpt-1b's width (fsdp 2 x tensor 4 on 8 H100s)
    # the GPU program's peak with them is 3.6 % above the plan's, a false "fits" at the limit
    # (61.41 compiled, 59.18 planned of 59.33 GiB; docs/planner.md §6 "Stop 30")
    collective_matmul: bool | Literal["auto"] = False

    def _validate(self) -> None:
        require(self.vocab_size != 1, "model.vocab_size", "must be 0 (from the data) or >= 2",
                self.vocab_size)
        if self.head_dim == 0:  # an explicit head_dim frees d_model from dividing by heads
            require(self.d_model % self.heads == 0, "model.d_model",
                     f"must be divisible by model.heads={self.heads}", self.d_model)
        require(self.kv_heads <= self.heads and self.heads % self.resolved_kv_heads == 0,
                 "model.kv_heads", f"must divide model.heads={self.heads} (or be 0)", self.kv_heads)
        require(self.resolved_head_dim % 2 == 0, "model.head_dim",
                "must be even (the rotary embedding turns pairs of dims)", self.resolved_head_dim)
        if self.rope_scaling == "llama3":
            require(self.rope_high_freq_factor > self.rope_low_freq_factor,
                    "model.rope_high_freq_factor",
                    f"must be > model.rope_low_freq_factor={self.rope_low_freq_factor}",
                    self.rope_high_freq_factor)

    @property
    def resolved_kv_heads(self) -> int:
        """Key/value heads actually built (grouped-query attention when < heads)."""
        return self.kv_heads or self.heads

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.d_model // self.heads

    @property
    def resolved_mlp_dim(self) -> int:
        """Hidden MLP width. SwiGLU uses 8/3·d_model (same params as a 4·d GELU MLP, having three
        matrices), rounded *up* to a multiple of 64 so matmuls tile and shard evenly."""
        if self.mlp_dim:
            return self.mlp_dim
        if self.activation == "swiglu":
            return 64 * math.ceil(round(8 * self.d_model / 3) / 64)
        return 4 * self.d_model


@dataclass(frozen=True)
class DataConfig(Section):
    """Tokens from bundled stdlib text (bytes), a synthetic stream, a flat .bin token file or a
    folder written by ``jaxmp data prepare`` (whose meta.json sets the token dtype)."""

    section: ClassVar[str] = "data"
    # "stdlib" (Python's own sources as bytes), "synthetic", a .bin token file, or a folder
    # written by `jaxmp data prepare`
    source: str = "stdlib"
    seq_len: int = bounded(128, ge=2)  # tokens per sequence
    token_dtype: Literal["uint16", "uint32"] = "uint16"  # of a .bin (a folder: its meta.json)
    eval_fraction: float = bounded(0.01, ge=0, lt=0.5)  # held-out tail of the stream, for eval

    def _validate(self) -> None:
        require(self.source in ("stdlib", "synthetic") or self.source.endswith(".bin")
                or os.path.isdir(self.source), "data.source",
                "expected 'stdlib', 'synthetic', a path ending in .bin or a folder written by "
                "`jaxmp data prepare`", self.source)


@dataclass(frozen=True)
class Config(TrainerConfig):
    """The trainer's sections plus the GPT's ``model`` and ``data``."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)

    def _validate(self) -> None:
        vocab, source = self.model.vocab_size, self.data.source
        if source == "stdlib":
            require(vocab == 0 or vocab >= 256, "model.vocab_size",
                    "must be 0 or >= 256 for byte-level data.source='stdlib'", vocab)
        if source.endswith(".bin") and self.data.token_dtype == "uint16":
            require(vocab <= 65536, "data.token_dtype",
                    f"uint16 cannot hold model.vocab_size={vocab} ids (use 'uint32')", "uint16")


def load_config(path: str | os.PathLike | None = None, overrides: Sequence[str] = (),
                schema: type[TrainerConfig] = Config) -> TrainerConfig:
    """Defaults (= configs/tiny.toml), then the file, then each ``section.key=value`` in order.

    ``schema``: the config class to load; the GPT recipe's :class:`Config` by default. Research
    code with its own model passes ``jaxmp.TrainerConfig`` (or a subclass adding its own
    sections), so its files need no ``[model]`` or ``[data]`` of the GPT's.
    """
    return load(schema, path, overrides)
