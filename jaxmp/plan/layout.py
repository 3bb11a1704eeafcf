"""What one train step runs: the record the planner decides and the Trainer builds.

:class:`Layout` holds every decision that shapes the compiled step — the mesh, the remat
policy, the microbatches, the pipeline schedule and its stage split, whether the data-axis
reduction leaves XLA's hands, the dtype fsdp gathers weights in, the gradient compression,
sequence parallelism. It is decided once (:func:`jaxmp.plan.make_plan`), built as is
(:class:`jaxmp.Trainer`), read back from what was built (``Trainer.executed_layout()``) and
compared field by field (the tests do, for every strategy ``jaxmp bench`` runs).

A new decision is one new field here: the planner fills it, the Trainer consumes it,
:meth:`Layout.to_json` shows it and :meth:`Layout.differences` compares it without further
code (``executed_layout`` reads it back).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from jaxmp._util.env import FSDP_ACCUMULATION_GPU_FLAGS, SINGLE_LAYER_BODY_GPU_FLAGS
from jaxmp.compression.reduce import Compression, reduced_after_microbatches
from jaxmp.mesh import AXES
from jaxmp.pipeline.stages import StageSplit


def mesh_items(sizes: Mapping[str, int]) -> tuple[tuple[str, int], ...]:
    """All four axes as ``((axis, size), ...)`` in mesh order (missing ones 1)."""
    return tuple((a, int(sizes.get(a, 1))) for a in AXES)


@dataclass(frozen=True)
class Layout:
    """One step's decided layout (see the module docstring).

    ``schedule`` is ``""`` and ``split`` None without pipeline stages; ``split`` cuts the
    pipeline's folded per-layer table (``pre``, each block, ``post``) into ``stages ×
    virtual_stages`` chunks. ``gather_dtype`` is what fsdp weight gathers move: ``"param"`` (as
    stored), ``"bfloat16"`` or ``"int8"``; ``reduce_dtype`` what fsdp's gradient
    reduce-scatters move, which follows from it (:func:`jaxmp.compression.gather.reduce_dtype`:
    ``"param"``, ``"bfloat16"``, or int8's compute dtype). ``compression`` is what the
    data-axis reduction sends (kind ``"none"`` without a data axis). ``attention`` is the
    attention kernel the model is built with, decided for the platform the run targets
    (``"xla"`` | ``"cudnn"``; ``""``: not the plan's to decide — a model that calls its
    attention its own way). ``optimizer_sharding`` is ``"data"`` when the optimizer state is
    sharded over the data axis as well (ZeRO-1, :mod:`jaxmp.train.zero`; only with
    ``data > 1``), else ``"none"``. ``sequence_parallel``: the residual stream's sequence dim
    is sharded over ``tensor`` (never without a tensor axis). ``master_weights`` is
    ``"float32"`` when the state keeps a float32 master of 16-bit params that the optimizer
    updates (:mod:`jaxmp.train.master`), else ``"none"``.
    """

    mesh: tuple[tuple[str, int], ...]
    remat: str
    microbatches: int
    schedule: str = ""
    virtual_stages: int = 1
    split: StageSplit | None = None
    reduce_after_microbatches: bool = False
    gather_dtype: str = "param"
    compression: Compression = field(default_factory=Compression)
    attention: str = ""
    reduce_dtype: str = "param"
    optimizer_sharding: str = "none"
    sequence_parallel: bool = False
    master_weights: str = "none"

    @property
    def sizes(self) -> dict[str, int]:
        return dict(self.mesh)

    @property
    def stages(self) -> int:
        return self.sizes.get("stage", 1)

    @property
    def accumulation(self) -> int:
        """Microbatches the plain step accumulates (1 with stages: the pipeline takes them)."""
        return self.microbatches if self.stages == 1 else 1

    @property
    def double_buffered(self) -> bool:
        """Whether XLA's GPU compiler runs this layout's layer loops two layers an iteration
        (jaxmp's default flags): not where fsdp gathers weights without pipeline stages —
        there the next iteration's gather was scheduled after the body's last matmul,
        exposed; one layer an iteration hides it
        (:data:`~jaxmp._util.env.SINGLE_LAYER_BODY_GPU_FLAGS`)."""
        return self.stages > 1 or self.sizes.get("fsdp", 1) == 1

    @property
    def xla_flags(self) -> str:
        """XLA flags this layout's GPU compile adds to jaxmp's (the config's and ``XLA_FLAGS``
        win): :data:`~jaxmp._util.env.FSDP_ACCUMULATION_GPU_FLAGS` where fsdp gathers weights
        and microbatches accumulate, so the backward's prefetch is not queued behind the
        gradient reduce-scatters (no extra in-flight buffer elsewhere); and
        :data:`~jaxmp._util.env.SINGLE_LAYER_BODY_GPU_FLAGS` where the layer loops are not
        double-buffered."""
        fsdp = self.sizes.get("fsdp", 1)
        flags = [FSDP_ACCUMULATION_GPU_FLAGS] if fsdp > 1 and self.accumulation > 1 else []
        flags += [] if self.double_buffered else [SINGLE_LAYER_BODY_GPU_FLAGS]
        return " ".join(flags)

    def to_json(self) -> dict[str, Any]:
        """Every field as plain JSON values (``plan.json``'s ``layout``)."""
        return {f.name: _json(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def differences(self, other: Layout) -> list[str]:
        """``"field: mine != other's"`` for each field that differs (empty: the same)."""
        return [f"{f.name}: {_json(getattr(self, f.name))!r} != {_json(getattr(other, f.name))!r}"
                for f in dataclasses.fields(self) if getattr(self, f.name) != getattr(other,
                                                                                     f.name)]


def _json(value: Any) -> Any:
    if isinstance(value, StageSplit):
        return {"chunks": [list(b) for b in value.bounds], "blocks_per_chunk": value.per_chunk,
                "n_blocks": value.n_blocks}
    if isinstance(value, Compression):
        return dataclasses.asdict(value)
    if isinstance(value, tuple) and value and isinstance(value[0], tuple):
        return dict(value)
    return value


def reduction(sizes: Mapping[str, int], compression: Compression, microbatches: int) -> bool:
    """The data-reduction decision for a layout (asked once, here, for every candidate):
    :func:`jaxmp.compression.reduce.reduced_after_microbatches`."""
    return reduced_after_microbatches(int(sizes.get("data", 1)), compression.kind, microbatches,
                                      int(sizes.get("stage", 1)))


def effective_compression(compression: Compression, data: int) -> Compression:
    """What the data-axis reduction sends: nothing to compress without a data axis (and
    ``none`` carries no settings)."""
    return compression if data > 1 and compression.kind != "none" else Compression()


def optimizer_sharding(configured: str, data: int, auto: str = "none") -> str:
    """The optimizer-state decision of a layout with ``data`` replicas: the configured
    ``train.optimizer_sharding``, ``auto`` for ``"auto"`` (the search tries both), and
    ``"none"`` whenever there is no data axis to shard over."""
    if data <= 1:
        return "none"
    return auto if configured == "auto" else configured


def master_weights(configured: str, param_dtype: str | None) -> str:
    """Whether a layout keeps a float32 master (``train.master_weights``): ``"float32"``
    where the model's narrowest float params (``param_dtype``; None: unknown) are 16-bit,
    unless the user said ``"none"`` — with float32 params there is nothing to keep."""
    narrow = param_dtype in ("bfloat16", "float16")
    return "float32" if narrow and configured != "none" else "none"


def sequence_parallel(setting: bool | str, tensor: int, seq_len: int | None) -> bool:
    """Whether a layout shards the residual stream's sequence over ``tensor``
    (``train.sequence_parallel``): never without a tensor axis; ``"auto"`` wherever the
    sequence (``seq_len``; None: unknown) divides by it — what a plan without costs takes;
    with costs the search tries it off and on where it applies
    (:func:`jaxmp.plan.sequence.choices`)."""
    if tensor <= 1 or setting is False:
        return False
    if setting == "auto":
        return seq_len is not None and seq_len % tensor == 0
    return True
