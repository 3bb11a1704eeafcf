"""What a run sends over the wire, built as its plan decided: the gradient reducer and the
weight-gather policy.

The plan's :class:`~jaxmp.plan.Layout` says (1) whether the data-axis gradient reduction is
taken out of XLA's hands (``reduce_after_microbatches``: to compress it, or to reduce once per
step under accumulation and pipeline stages), with what encoding (``compression``,
:mod:`jaxmp.compression.reduce`), and (2) in which dtype fsdp gathers weights
(``gather_dtype``, :mod:`jaxmp.compression.gather`), and (3) whether activations shard the
sequence over ``tensor`` (``sequence_parallel``, :mod:`jaxmp.sharding.sequence`). Nothing is
decided here; with none of them, the step is exactly XLA's plain program.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jax.sharding import Mesh

from jaxmp import sharding
from jaxmp.compression.gather import WeightGather, weight_gather
from jaxmp.compression.reduce import STATE_KEY, Reducer, state_extension
from jaxmp.config import TrainerConfig
from jaxmp.plan import Layout


def extensions(layout: Layout, path_rules: Sequence | None) -> dict[str, Any]:
    """The state the reduction carries (``TrainState.extra["grad_compression"]``), if any."""
    comp = layout.compression
    if not comp.stateful or not layout.reduce_after_microbatches:
        return {}
    return {STATE_KEY: state_extension(comp, layout.sizes["data"], path_rules)}


def reducer(layout: Layout, mesh: Mesh, state: Any, path_rules: Sequence | None,
            warmup: bool = False, params: Any = None) -> Reducer | None:
    """The step's reducer (None: XLA reduces). ``warmup``: PowerSGD's uncompressed steps,
    which reduce as XLA would when nothing else needs the reducer. ``params``: the shardings
    of the params the model computes with (default the state's; with master weights the
    model's, :mod:`jaxmp.train.master`)."""
    if not layout.reduce_after_microbatches:
        return None
    comp = layout.compression.uncompressed() if warmup else layout.compression
    if comp.kind == "none" and layout.accumulation == 1 and layout.stages == 1:
        return None
    return Reducer(comp, mesh, state.abstract.params,
                   state.shardings.params if params is None else params, path_rules,
                   scatter=layout.optimizer_sharding == "data")


def warmup_steps(layout: Layout) -> int:
    """Steps that run the uncompressed program first (``compression.powersgd_start``)."""
    return layout.compression.warmup_steps() if layout.reduce_after_microbatches else 0


def gather(layout: Layout, mesh: Mesh, rules: Sequence,
           compute_dtype: str | None) -> WeightGather | None:
    return weight_gather(layout.gather_dtype, compute_dtype, mesh, rules)


def summary(config: TrainerConfig, layout: Layout, gather_policy: WeightGather | None) -> str:
    """One line for the run's start (empty when nothing is changed from XLA's defaults)."""
    kind, parts = config.compression.gradients, []
    if kind != "none":
        parts.append(f"gradients reduced as {kind}" if layout.sizes["data"] > 1 else
                     f"compression.gradients={kind!r} has no effect without a "
                     f"data axis (mesh.data=1)")
    if gather_policy is not None:
        parts.append(f"fsdp weights gathered as {gather_policy.wire}, gradients reduced as "
                     f"{gather_policy.reduce}")
    if layout.master_weights != "none":
        over = " sharded over data" if layout.optimizer_sharding == "data" else ""
        parts.append(f"{layout.master_weights} master weights{over} beside the optimizer's "
                     f"moments")
    if layout.sequence_parallel:
        parts.append(f"residual stream split along the sequence over tensor="
                     f"{layout.sizes['tensor']} (sequence parallel)")
    return "; ".join(parts)


def activation_rules(layout: Layout, rules: Sequence) -> tuple:
    """The rules the step constrains activations with: ``rules``, with the residual stream's
    sequence over ``tensor`` when the layout says so (:mod:`jaxmp.sharding.sequence`);
    parameters keep ``rules``."""
    return sharding.sequence_parallel_rules(rules) if layout.sequence_parallel \
        else sharding.normalize_rules(rules)
