"""What a run sends over the wire: its gradient reducer and its weight-gather policy.

The Trainer asks here, from its config and mesh, (1) whether the data-axis gradient reduction
is taken out of XLA's hands — needed to compress it (``compression.gradients``) and to reduce
once per step under gradient accumulation and pipeline stages — and with what state
(:mod:`jaxmp.compression.reduce`),
and (2) in which dtype fsdp gathers weights (``compression.weights``,
:mod:`jaxmp.compression.gather`). With neither, the step is exactly XLA's plain program.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jax.sharding import Mesh

from jaxmp.config import TrainerConfig
from jaxmp.train.planning import accumulation
from jaxmp.compression.gather import WeightGather, weight_gather
from jaxmp.compression.reduce import (STATE_KEY, Compression, Reducer, reduced_after_microbatches,
                                   state_extension)


def data_size(mesh: Mesh) -> int:
    return int(dict(mesh.shape).get("data", 1))


def compression_of(config: TrainerConfig) -> Compression:
    return Compression.from_config(config.compression)


def stages(mesh: Mesh) -> int:
    return int(dict(mesh.shape).get("stage", 1))


def uses_reducer(config: TrainerConfig, mesh: Mesh) -> bool:
    """A reducer is needed to compress, or to accumulate microbatches (or a pipeline's
    chunks) before reducing: once per step instead of once per microbatch."""
    return reduced_after_microbatches(data_size(mesh), config.compression.gradients,
                                      accumulation(config, mesh), stages(mesh))


def extensions(config: TrainerConfig, mesh: Mesh, path_rules: Sequence | None) -> dict[str, Any]:
    """The state the reduction carries (``TrainState.extra["grad_compression"]``), if any."""
    comp = compression_of(config)
    if not comp.stateful or data_size(mesh) == 1:
        return {}
    return {STATE_KEY: state_extension(comp, data_size(mesh), path_rules)}


def reducer(config: TrainerConfig, mesh: Mesh, layout: Any, path_rules: Sequence | None,
            warmup: bool = False) -> Reducer | None:
    """The step's reducer (None: XLA reduces). ``warmup``: PowerSGD's uncompressed steps."""
    if not uses_reducer(config, mesh):
        return None
    comp = compression_of(config)
    if warmup:
        comp = comp.uncompressed()
    if comp.kind == "none" and accumulation(config, mesh) == 1 and stages(mesh) == 1:
        return None
    return Reducer(comp, mesh, layout.abstract.params, layout.shardings.params, path_rules)


def warmup_steps(config: TrainerConfig, mesh: Mesh) -> int:
    """Steps that run the uncompressed program first (``train.powersgd_start``)."""
    return compression_of(config).warmup_steps() if uses_reducer(config, mesh) else 0


def gather(config: TrainerConfig, mesh: Mesh, rules: Sequence,
           compute_dtype: str | None) -> WeightGather | None:
    return weight_gather(config.compression.weights, compute_dtype, mesh, rules)


def summary(config: TrainerConfig, mesh: Mesh, gather_policy: WeightGather | None) -> str:
    """One line for the run's start (empty when nothing is changed from XLA's defaults)."""
    kind, parts = config.compression.gradients, []
    if kind != "none":
        parts.append(f"gradients reduced as {kind}" if data_size(mesh) > 1 else
                     f"compression.gradients={kind!r} has no effect without a "
                     f"data axis (mesh.data=1)")
    if gather_policy is not None:
        parts.append(f"fsdp weights gathered as {gather_policy.wire}")
    return "; ".join(parts)
