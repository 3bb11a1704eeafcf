"""Typed, validated run configuration: TOML file + ``section.key=value`` overrides.

Stdlib only and jax-free on purpose: the CLI reads ``xla.flags`` from here and must put them in
``XLA_FLAGS`` before jax is first imported. Every mistake a user can make in a file or a ``--set``
surfaces as one :class:`ConfigError` line naming the key, so the CLI can print it and exit 2
before any device work starts. The dataclass defaults *are* ``configs/tiny.toml`` (tested).
"""

import dataclasses
import difflib
import math
import os
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from jaxmp.config_fields import ConfigError, _coerce, _f, _require, _Section, _show
from typing import Any, ClassVar, Literal

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
MESH_AXES: tuple[str, ...] = ("data", "stage", "fsdp", "tensor")
AxisSize = int | Literal["auto"]
@dataclass(frozen=True)
class ModelConfig(_Section):
    """Decoder-only transformer shape; 0 in kv_heads / head_dim / mlp_dim means "derive it"."""

    section: ClassVar[str] = "model"
    layers: int = _f(4, ge=1)
    d_model: int = _f(128, ge=1)
    heads: int = _f(4, ge=1)
    kv_heads: int = _f(0, ge=0)
    head_dim: int = _f(0, ge=0)
    mlp_dim: int = _f(0, ge=0)
    vocab_size: int = _f(256, ge=2)
    activation: Literal["gelu", "swiglu"] = "gelu"
    tie_embeddings: bool = True
    scan_layers: bool = True
    remat: Literal["none", "save_dots", "full"] = "none"
    compute_dtype: Literal["float32", "bfloat16"] = "float32"
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    norm_eps: float = _f(1e-5, gt=0)
    init_std: float = _f(0.02, gt=0)

    def _validate(self) -> None:
        if self.head_dim == 0:  # an explicit head_dim frees d_model from dividing by heads
            _require(self.d_model % self.heads == 0, "model.d_model",
                     f"must be divisible by model.heads={self.heads}", self.d_model)
        _require(self.kv_heads <= self.heads and self.heads % self.resolved_kv_heads == 0,
                 "model.kv_heads", f"must divide model.heads={self.heads} (or be 0)", self.kv_heads)

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
class MeshConfig(_Section):
    """Mesh axis sizes: an int, -1 (fill the remaining devices) or "auto" (planner decides)."""

    section: ClassVar[str] = "mesh"
    data: AxisSize = "auto"
    stage: AxisSize = "auto"
    fsdp: AxisSize = "auto"
    tensor: AxisSize = "auto"

    def _validate(self) -> None:
        for axis, size in self.explicit().items():
            _require(size >= 1 or size == -1, f"mesh.{axis}",
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

        Once any axis is explicit the "auto" ones become 1: the user spelled the mesh out.
        All "auto" without a planner falls back to data parallelism: ``{"data": -1, rest: 1}``.
        """
        if self.is_auto:
            return {"data": -1, "stage": 1, "fsdp": 1, "tensor": 1}
        return {a: 1 if getattr(self, a) == "auto" else getattr(self, a) for a in MESH_AXES}


@dataclass(frozen=True)
class DataConfig(_Section):
    """Tokens from bundled stdlib text (bytes), a synthetic stream, or a flat .bin token file."""

    section: ClassVar[str] = "data"
    source: str = "stdlib"
    seq_len: int = _f(128, ge=2)
    token_dtype: Literal["uint16", "uint32"] = "uint16"
    eval_fraction: float = _f(0.01, ge=0, lt=0.5)

    def _validate(self) -> None:
        _require(self.source in ("stdlib", "synthetic") or self.source.endswith(".bin"),
                 "data.source", "expected 'stdlib', 'synthetic' or a path ending in .bin",
                 self.source)


@dataclass(frozen=True)
class OptimizerConfig(_Section):
    """AdamW, linear warmup then cosine decay to ``lr * min_lr_ratio``; clip_norm 0 = off."""

    section: ClassVar[str] = "optimizer"
    lr: float = _f(3e-3, gt=0)
    min_lr_ratio: float = _f(0.1, ge=0, le=1)
    warmup_steps: int = _f(20, ge=0)
    weight_decay: float = _f(0.1, ge=0)
    beta1: float = _f(0.9, ge=0, lt=1)
    beta2: float = _f(0.95, ge=0, lt=1)
    eps: float = _f(1e-8, gt=0)
    clip_norm: float = _f(1.0, ge=0)


@dataclass(frozen=True)
class TrainConfig(_Section):
    """Loop length and batch. batch_size is global, in sequences, and split over grad_accum."""

    section: ClassVar[str] = "train"
    steps: int = _f(200, ge=1)
    batch_size: int = _f(16, ge=1)
    seed: int = _f(0, ge=0)
    grad_accum: int = _f(1, ge=1)
    eval_every: int = _f(100, ge=0)  # 0 = no evaluation
    eval_batches: int = _f(4, ge=1)

    def _validate(self) -> None:
        _require(self.batch_size % self.grad_accum == 0, "train.batch_size",
                 f"must be divisible by train.grad_accum={self.grad_accum}", self.batch_size)


@dataclass(frozen=True)
class CheckpointConfig(_Section):
    """every: period in steps (0 = only at the end); keep_period K > 0 keeps every K-th step."""

    section: ClassVar[str] = "checkpoint"
    every: int = _f(100, ge=0)
    keep: int = _f(3, ge=1)
    keep_period: int = _f(0, ge=0)
    async_save: bool = True
    enabled: bool = True


@dataclass(frozen=True)
class LoggingConfig(_Section):
    """profile_steps: [] or the [start, stop) steps to capture in a jax.profiler trace."""

    section: ClassVar[str] = "logging"
    every: int = _f(10, ge=1)
    profile_steps: tuple[int, ...] = ()
    progress: bool = True
    tensorboard: bool = True

    def _validate(self) -> None:
        ps = self.profile_steps
        _require(not ps or (len(ps) == 2 and 0 <= ps[0] < ps[1]), "logging.profile_steps",
                 "must be [] or [start, stop] with 0 <= start < stop", ps)


@dataclass(frozen=True)
class XlaConfig(_Section):
    """flags: appended to XLA_FLAGS before jax starts; matmul_precision: jax's default."""

    section: ClassVar[str] = "xla"
    flags: str = ""
    matmul_precision: Literal["default", "high", "highest", "bfloat16", "tensorfloat32",
                              "float32"] = "default"

    def _validate(self) -> None:
        for flag in self.flags.split():
            _require(flag.startswith("--"), "xla.flags", "every flag must start with '--'", flag)


@dataclass(frozen=True)
class DeviceConfig(_Section):
    """Device profile for MFU and the planner; 0 keeps the detected profile's value."""

    section: ClassVar[str] = "device"
    kind: str = "auto"  # "auto" (detect), or a profile name: A100-40GB, A100-80GB, H100, H200, CPU
    peak_flops: float = _f(0.0, ge=0)  # FLOP/s per device (dense bf16)
    memory_bytes: float = _f(0.0, ge=0)
    memory_bw: float = _f(0.0, ge=0)  # bytes/s
    intra_host_bw: float = _f(0.0, ge=0)  # bytes/s per device inside a host
    inter_host_bw: float = _f(0.0, ge=0)  # bytes/s per device across hosts
    devices_per_host: int = _f(0, ge=0)
    usable_fraction: float = _f(0.0, ge=0, le=1)  # of memory_bytes the planner may fill


@dataclass(frozen=True)
class Config:
    """The whole run configuration; one frozen dataclass per TOML section."""

    model: ModelConfig = field(default_factory=ModelConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    xla: XlaConfig = field(default_factory=XlaConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            _require(isinstance(getattr(self, f.name), f.type), f.name,
                     f"expected a {f.type.__name__}", getattr(self, f.name))
        vocab, source = self.model.vocab_size, self.data.source
        if source == "stdlib":
            _require(vocab >= 256, "model.vocab_size",
                     "must be >= 256 for byte-level data.source='stdlib'", vocab)
        if source.endswith(".bin") and self.data.token_dtype == "uint16":
            _require(vocab <= 65536, "data.token_dtype",
                     f"uint16 cannot hold model.vocab_size={vocab} ids (use 'uint32')", "uint16")


SECTIONS: dict[str, Any] = {f.name: f.type for f in dataclasses.fields(Config)}
_FIELDS = {s: {f.name: f.type for f in dataclasses.fields(c)} for s, c in SECTIONS.items()}


def _check_section(section: str, where: str = "") -> None:
    if section not in SECTIONS:
        close = difflib.get_close_matches(section, list(SECTIONS), n=1)
        hint = f"did you mean '{close[0]}'?" if close else f"sections: {', '.join(SECTIONS)}"
        raise ConfigError(f"unknown config section '{section}'{where} ({hint})")


def _set(raw: dict[str, dict[str, Any]], section: str, key: str, value: Any) -> None:
    """Type-check one value into ``raw``; an unknown key gets the likeliest intended name."""
    types_ = _FIELDS[section]
    if key not in types_:
        everywhere = [f"{s}.{k}" for s in SECTIONS for k in _FIELDS[s]]
        guess = ([f"{section}.{k}" for k in difflib.get_close_matches(key, list(types_), n=1)]
                 or [name for name in everywhere if name.endswith("." + key)]  # wrong section
                 or difflib.get_close_matches(f"{section}.{key}", everywhere, n=1))
        hint = f" (did you mean '{guess[0]}'?)" if guess else ""
        raise ConfigError(f"unknown config key '{section}.{key}'{hint}")
    raw.setdefault(section, {})[key] = _coerce(f"{section}.{key}", types_[key], value)


def _read_toml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {' '.join(str(exc).split())}") from None
    except (OSError, UnicodeDecodeError) as exc:  # unreadable, or not UTF-8 text
        raise ConfigError(f"{path}: cannot read: {' '.join(str(exc).split())}") from None


def parse_override(text: str) -> tuple[str, str, Any]:
    """Split ``"section.key=value"``; the value is TOML if it parses, else a bare string.

    The bare-string fallback lets shells pass ``model.activation=swiglu`` or
    ``data.source=/data/tokens.bin`` without nested quoting.
    """
    lhs, eq, rhs = text.partition("=")
    section, dot, key = lhs.strip().partition(".")
    if not (eq and dot and section and key.strip()):
        raise ConfigError(f"malformed override {_show(text)}: expected section.key=value")
    try:
        parsed = tomllib.loads(f"v = {rhs}")
        value = parsed["v"] if len(parsed) == 1 else rhs.strip()  # "1\nw = 2" is no value
    except tomllib.TOMLDecodeError:
        value = rhs.strip()
    return section, key.strip(), value


def _build(raw: Mapping[str, Mapping[str, Any]]) -> Config:
    return Config(**{name: cls(**raw.get(name, {})) for name, cls in SECTIONS.items()})


def load_config(path: str | os.PathLike | None = None, overrides: Sequence[str] = ()) -> Config:
    """Defaults (= configs/tiny.toml), then the file, then each ``section.key=value`` in order."""
    if isinstance(overrides, str):  # a lone string would otherwise iterate per character
        overrides = [overrides]
    raw: dict[str, dict[str, Any]] = {}
    if path is not None:
        path = Path(path)
        for section, table in _read_toml(path).items():
            try:
                _check_section(section)
                _require(isinstance(table, dict), section, "expected a [section] table", table)
                for key, value in table.items():
                    _set(raw, section, key, value)
            except ConfigError as exc:
                raise ConfigError(f"{path}: {exc}") from None
    for text in overrides:
        section, key, value = parse_override(text)
        _check_section(section, f" in override {_show(text)}")
        _set(raw, section, key, value)
    return _build(raw)


def replace(config: Config, **sections: Mapping[str, Any]) -> Config:
    """A new, re-validated config with fields changed: ``replace(cfg, train={"steps": 10})``."""
    raw = config_to_dict(config)
    for name, update in sections.items():
        _check_section(name)
        for key, value in update.items():
            _set(raw, name, key, value)
    return _build(raw)


def config_to_dict(config: Config) -> dict[str, dict[str, Any]]:
    """``{section: {key: value}}`` with plain TOML/JSON values (tuples become lists)."""
    return {name: {k: list(v) if isinstance(v, tuple) else v
                   for k, v in dataclasses.asdict(getattr(config, name)).items()}
            for name in SECTIONS}


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    escape = {"\\": "\\\\", '"': '\\"'}
    return '"' + "".join(escape.get(c) or (f"\\u{ord(c):04x}" if ord(c) < 32 or ord(c) == 127
                                           else c) for c in value) + '"'


def config_to_toml(config: Config) -> str:
    """The effective config as TOML (a run directory's config.toml); loads back equal."""
    lines = ["# Effective jaxmp config: defaults, then the config file, then --set overrides."]
    for name, table in config_to_dict(config).items():
        lines += ["", f"[{name}]"] + [f"{k} = {_toml_value(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"
