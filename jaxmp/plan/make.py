"""The one planning function: a run's config (+ a model's costs, if any) → a :class:`Plan`.

:func:`make_plan` is called once per run, by whoever builds the step: the Trainer (for any
model), ``jaxmp train`` (the GPT recipe, every remat policy ranked when ``model.remat`` is
``auto``), ``jaxmp plan`` (and its ``--compare``, the same call with more keys fixed) and
``jaxmp bench`` (each strategy's mesh fixed). Every key the config fixes is a constraint of the
call; every ``"auto"`` is decided here:

* **with costs** (a :class:`~jaxmp.cost.ModelCost`): the search (:func:`jaxmp.plan.plan`) ranks
  every mesh factorisation, remat policy, microbatch count and pipeline schedule allowed and
  picks the fastest runnable layout that fits;
* **without costs** (research code with no example batch): the config's values with documented
  defaults and no predictions — mesh: the fixed axes, ``"auto"`` ones 1 (all ``"auto"``: data
  parallel); ``train.microbatches = "auto"``: 1 without stages, 2 × stages with them;
  ``pipeline.schedule = "auto"``: 1f1b (interleaved: 2 virtual stages); ``pipeline.balance =
  "flops"`` needs costs (bad input); ``train.sequence_parallel = "auto"``: off (nothing
  says the model names its sequence dim, or how long it is).

The mesh: an axis set to an integer is fixed; ``-1`` takes what the others leave (then the
mesh is spelled out and ``"auto"`` axes are 1); ``"auto"`` axes are the planner's when it has
costs. Settings that cannot run (a pipeline schedule with too few microbatches, a batch the
batch axes cannot split, ...) are refused here, in one line naming the key.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Collection, Mapping, Sequence

from jaxmp import sharding
from jaxmp._util.fmt import mesh_str
from jaxmp.compression.gather import gather_dtype, reduce_dtype
from jaxmp.compression.reduce import Compression
from jaxmp.config import MeshConfig, TrainerConfig
from jaxmp.cost import ModelCost
from jaxmp.devices import profile_from_config
from jaxmp.errors import ConfigError
from jaxmp.mesh import AXES, resolve_axes
from jaxmp.models.attention import AttentionChoice
from jaxmp.pipeline.footprint import stack_span
from jaxmp.pipeline.schedule import Schedule
from jaxmp.pipeline.stages import split_layers
from jaxmp.plan.layout import (Layout, effective_compression, master_weights, mesh_items,
                               optimizer_sharding, reduction, sequence_parallel)
from jaxmp.plan.plan import Plan, plan
from jaxmp.plan.search import PipelineOptions
from jaxmp.sharding.sequence import SEQ

NO_SPEC = ("this model cannot be split into stages (it needs a PipelineSpec: pre, a stacked "
           "layer module, post)")


def mesh_constraint(mesh: MeshConfig, n_devices: int) -> tuple[dict[str, int], bool]:
    """``(axes, complete)``: the axes the config fixes and whether they are the whole mesh
    (all four sizes, resolved). Bad input — a size the devices cannot hold — raises."""
    if mesh.is_auto:
        return {}, False
    explicit = mesh.explicit()
    complete = -1 in explicit.values() or len(explicit) == len(AXES) or \
        math.prod(explicit.values()) == n_devices
    if complete or n_devices % math.prod(explicit.values()):
        return _resolved(mesh, n_devices), True
    return dict(explicit), False


def _resolved(mesh: MeshConfig, n_devices: int) -> dict[str, int]:
    try:
        return resolve_axes(mesh.sizes(), n_devices)
    except ValueError as e:  # a config that cannot fit the devices is bad input, not a crash
        raise ConfigError(f"mesh: {e}") from None


def batch_axes(sizes: Mapping[str, int], rules: Sequence) -> dict[str, int]:
    """The mesh axes (and sizes) the rules split the logical ``batch`` over."""
    n = math.prod(sizes.values())  # divisible by every axis product
    spec = sharding.resolve(("batch",), (n,), dict(sizes), sharding.normalize_rules(rules)).spec
    axes = [a for e in spec if e is not None for a in ((e,) if isinstance(e, str) else e)]
    return {a: int(sizes[a]) for a in axes}


def check_batch(sizes: Mapping[str, int], rules: Sequence, batch_size: int,
                microbatches: int = 1) -> None:
    """Refuse a global batch (or microbatch) that the batch axes cannot split evenly.

    Without this the rules' divisibility fallback would replicate the batch: every device
    computing every row, silently.
    """
    axes = batch_axes(sizes, rules)
    n = math.prod(axes.values())
    where = f"the {n} batch shards of mesh {mesh_str(axes)}"
    if batch_size % n:
        raise ConfigError(f"train.batch_size: {batch_size} does not divide over {where}; "
                          f"use a multiple of {n}")
    micro = batch_size // microbatches
    if microbatches > 1 and micro % n:
        raise ConfigError(f"train.batch_size: {batch_size} / train.microbatches={microbatches} "
                          f"= {micro} rows per microbatch, which do not divide over {where}; "
                          f"use a multiple of {n * microbatches}")


def _pipeline_defaults(config: TrainerConfig, stages: int) -> tuple[str, int, int | str]:
    """The schedule, virtual stages and microbatches the config gives, ``"auto"`` resolved the
    way that needs least (what every searched alternative needs at least)."""
    pc = config.pipeline
    kind = "1f1b" if pc.schedule == "auto" else pc.schedule
    virtual = pc.virtual_stages if pc.virtual_stages != "auto" else \
        2 if kind == "interleaved" else 1
    return kind, int(virtual), config.train.microbatches


def check_stages(config: TrainerConfig, sizes: Mapping[str, int], pipeline: bool,
                 n_blocks: int | None) -> None:
    """Refuse pipeline settings no layout with ``sizes``' stage count can run."""
    stages = int(sizes.get("stage", 1))
    if stages == 1:
        return
    if not pipeline:
        raise ConfigError(f"mesh.stage={stages}: {NO_SPEC}")
    kind, virtual, microbatches = _pipeline_defaults(config, stages)
    Schedule(kind, stages, microbatches if microbatches != "auto" else stages, virtual)
    if n_blocks is not None:
        split_layers([1.0] * (n_blocks + 2), stages, virtual, "layers")  # enough blocks?
    shards = int(sizes.get("data", 1) * sizes.get("fsdp", 1))
    rows = config.train.batch_size
    if microbatches != "auto" and rows % (microbatches * shards):
        raise ConfigError(f"train.batch_size={rows} does not split into train.microbatches="
                          f"{microbatches} x {shards} batch shards (data x fsdp)")


def make_plan(config: TrainerConfig, cost: ModelCost | None, n_devices: int, *,
              rules: Sequence | None = None, pipeline: bool = True,
              stack_blocks: int | None = None, compute_dtype: str | None = None,
              remat: str = "none", remats: Sequence[str] | None = None,
              device_kind: str | None = None, strict: bool = False, measure_cpu: bool = False,
              top: int = 8, find_devices_needed: bool = True,
              attention: AttentionChoice | None = None,
              param_dtype: str | None = None) -> Plan:
    """The plan of one run: ``config``'s fixed keys as constraints, every ``"auto"`` decided.

    ``cost``: the model's per-layer costs (None: the config with defaults, no predictions);
    ``rules``: the complete rule list the step will use; ``pipeline``: whether the model can
    be split into stages (its Trainer has a PipelineSpec) and ``stack_blocks`` the blocks of
    its stack; ``compute_dtype`` the dtype it computes in (what ``compression.weights =
    "auto"`` gathers); ``remat`` its policy when there are no costs (with costs:
    ``cost.runs_as``, ``"auto"``: ranked); ``remats`` the policies to rank (default: the
    runnable one, every costed one when ``auto``); ``attention`` the attention kernel chosen
    for the platform the run targets (:func:`jaxmp.models.attention.choose_attention`; the
    costs must be traced with it), recorded in the layout (None: the model's own business).

    Every process of a multi-host run must reach the same plan, so the Trainer keeps
    ``strict=False`` (an unknown device kind describes itself) and ``measure_cpu=False`` (no
    measured number). ``jaxmp plan`` passes ``strict=True, measure_cpu=True``.
    """
    start = time.perf_counter()
    rules = sharding.normalize_rules(rules or sharding.DEFAULT_RULES)
    if n_devices < 1:
        raise ConfigError(f"the device count must be >= 1, got {n_devices}")
    fixed, complete = mesh_constraint(config.mesh, n_devices)
    if cost is None:
        fixed, complete = _resolved(config.mesh, n_devices), True
    n_blocks = _blocks(cost, stack_blocks)
    microbatches = config.train.microbatches
    if complete:
        check_batch(fixed, rules, config.train.batch_size,
                    microbatches if microbatches != "auto" and fixed.get("stage", 1) == 1 else 1)
        check_stages(config, fixed, pipeline, n_blocks)
    compression = Compression.from_config(config.compression)
    if cost is None:
        return _with_attention(_from_config(config, fixed, rules, n_blocks, compression,
                                            compute_dtype, remat, start, param_dtype),
                               attention)
    profile = profile_from_config(config.device, device_kind, strict=strict,
                                  measure_cpu=measure_cpu)
    auto = cost.runs_as == "auto"
    if not remats:
        remats = tuple(cost.layers[0].saved) if auto and cost.layers else (cost.runs_as,)
    pc = config.pipeline
    result = plan(cost, n_devices, profile, rules=rules, fixed=fixed, remats=tuple(remats),
                  microbatches=microbatches, configured_remat=None if auto else cost.runs_as, top=top,
                  pipeline=PipelineOptions(pc.schedule, pc.virtual_stages, runnable=pipeline),
                  balance=pc.balance, compression=compression,
                  weights=config.compression.weights, compute_dtype=compute_dtype,
                  find_devices_needed=find_devices_needed,
                  optimizer_sharding=config.train.optimizer_sharding,
                  sequence_parallel=config.train.sequence_parallel,
                  master_weights=config.train.master_weights)
    check_sequence_parallel(config, cost, result.layout)
    result.notes.extend(_idle_settings(config, result.layout))
    if result.layout.split is not None and stack_blocks is not None and \
            result.layout.split.n_blocks != stack_blocks:
        raise ConfigError(f"the model's layer stack has {stack_blocks} blocks but its costs "
                          f"have {result.layout.split.n_blocks}")
    result.planning_time_s = time.perf_counter() - start
    return _with_attention(result, attention)


def _idle_settings(config: TrainerConfig, layout: Layout) -> list[str]:
    """Notes for settings the user turned on that the chosen layout cannot act on (not
    errors: they shard over an axis of size 1, or over nothing the axis divides)."""
    notes = []
    if config.train.optimizer_sharding == "data" and layout.optimizer_sharding != "data":
        notes.append(f"train.optimizer_sharding='data' shards nothing here (data="
                     f"{layout.sizes['data']}): the optimizer state is sharded as the params")
    if config.train.sequence_parallel is True and not layout.sequence_parallel:
        notes.append("train.sequence_parallel=true: the chosen layout does not shard the "
                     f"sequence (tensor={layout.sizes['tensor']})")
    return notes


def _with_attention(result: Plan, attention: AttentionChoice | None) -> Plan:
    """``result`` with the attention kernel in its layout and the reason in its notes."""
    if attention is not None:
        result.layout = dataclasses.replace(result.layout, attention=attention.implementation)
        result.notes.append(str(attention))
    return result


def check_sequence_parallel(config: TrainerConfig, cost: ModelCost, layout: Layout) -> None:
    """Refuse ``train.sequence_parallel = true`` where the chosen layout cannot shard the
    sequence: a sequence the tensor axis does not divide, or a model that never names its
    sequence dim (``constrain(x, ("batch", "seq", ...))``) — it would silently do nothing."""
    tensor = layout.sizes["tensor"]
    if config.train.sequence_parallel is not True or tensor == 1:
        return
    refuse_unnamed_sequence(cost.activation_names)
    if cost.seq_len % tensor:
        raise ConfigError(f"train.sequence_parallel=true: the sequence length {cost.seq_len} "
                          f"does not divide over mesh.tensor={tensor}")


def refuse_unnamed_sequence(names: Collection[str]) -> None:
    """Sequence parallelism acts only through the name ``seq`` in a model's activation
    constraints: a model whose constraints (``names``, recorded while tracing) never use it
    would run the plain step while its layout said otherwise."""
    if SEQ not in names:
        raise ConfigError("train.sequence_parallel=true: the model names no activation's "
                          f"sequence dim {SEQ!r} (rules.constrain(x, ('batch', 'seq', ...)); "
                          "a model with its own names: call its sequence dim 'seq')")


def _blocks(cost: ModelCost | None, stack_blocks: int | None) -> int | None:
    if cost is None:
        return stack_blocks
    span = stack_span([lay.kind for lay in cost.layers],
                      [lay.group or lay.name for lay in cost.layers])
    return span[1] - span[0] if span else stack_blocks


def _from_config(config: TrainerConfig, sizes: dict[str, int], rules: tuple,
                 n_blocks: int | None, compression: Compression, compute_dtype: str | None,
                 remat: str, start: float, param_dtype: str | None = None) -> Plan:
    """The layout without model costs: the config's values and the documented defaults."""
    stages = sizes["stage"]
    kind, virtual, configured = _pipeline_defaults(config, stages)
    microbatches = int(configured) if configured != "auto" else 2 * stages if stages > 1 else 1
    split = None
    if stages > 1:
        if config.pipeline.balance == "flops":
            raise ConfigError("pipeline.balance='flops' needs the model's costs (give the "
                              "Trainer an example_batch) or use pipeline.balance='layers'")
        split = split_layers([1.0] * (int(n_blocks or 0) + 2), stages, virtual, "layers")
    comp = effective_compression(compression, sizes["data"])
    wire = gather_dtype(config.compression.weights, compute_dtype, sizes["fsdp"])
    layout = Layout(mesh_items(sizes), remat, microbatches, kind if stages > 1 else "",
                    virtual if stages > 1 else 1, split, reduction(sizes, comp, microbatches),
                    wire, comp, reduce_dtype=reduce_dtype(wire, compute_dtype),
                    optimizer_sharding=optimizer_sharding(config.train.optimizer_sharding,
                                                          sizes["data"]),
                    sequence_parallel=sequence_parallel(config.train.sequence_parallel,
                                                        sizes["tensor"], None),
                    master_weights=master_weights(config.train.master_weights, param_dtype))
    if stages > 1:
        Schedule(layout.schedule, stages, microbatches, layout.virtual_stages)  # validates
    return Plan(layout, predicted=None, fits=None, runnable=True, rules=rules,
                n_devices=math.prod(sizes.values()), planning_time_s=time.perf_counter() - start,
                notes=["no model costs to plan from (give the Trainer an example_batch): the "
                       "config's layout with defaults, no predictions"])
