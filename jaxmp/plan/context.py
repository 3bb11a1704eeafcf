"""What every candidate layout shares: the model's per-layer costs resolved on a mesh.

:class:`Context` holds a model's costs, the device profile and the rules, and computes — once
per (remat, mesh shape, microbatches), cached — the per-layer table (:class:`LayerTable`,
one named array per quantity) both predictors
(:mod:`jaxmp.plan.predict` without pipeline stages, :mod:`jaxmp.plan.pipeline` with them)
sum: parameter bytes as the rules shard them, saved activations at a device's rows, each
layer's backward working set, its compute time at the profile's achievable rate and the
bytes its tensor-parallel all-reduces move.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxmp import sharding
from jaxmp.compression.gather import gather_dtype, reduce_dtype
from jaxmp.compression.reduce import Compression, bytes_factor
from jaxmp.cost import ModelCost
from jaxmp.devices import DeviceProfile
from jaxmp.pipeline.footprint import fold, stack_span
from jaxmp.pipeline.stages import StageSplit, split_layers
from jaxmp.plan.sequence import choices as sequence_choices, regather_bytes
from jaxmp.plan.shard import LayerShard, resolve_shard
from jaxmp.plan.divisor import saved_divisor
from jaxmp.plan.gemm import compute_seconds
from jaxmp.plan.links import link_bw
from jaxmp.plan.lookup import lookup_wire_bytes
from jaxmp.plan.layout import (Layout, effective_compression, mesh_items, optimizer_sharding,
                               reduction)
from jaxmp.plan.master import itemsize, master_weights_of
from jaxmp.plan.scan import stores_fused
from jaxmp.remat import keeps_layer
from jaxmp.sharding.optimizer import data_dim
from jaxmp.sharding.sequence import SEQ


@dataclass(frozen=True)
class LayerTable:
    """Per-layer quantities of one (remat, data, fsdp, tensor, microbatches): one array per
    field, one entry per layer of the cost model, per device and per microbatch of
    ``rows / (data · fsdp · microbatches)`` rows unless noted."""

    kept: np.ndarray  # activations kept for the backward as the layer runs (fused outside a
    # loop), plus fsdp-gathered weights kept for it
    saved: np.ndarray  # activations a scan stores for the backward (fused ones on GPUs)
    work: np.ndarray  # the backward working set: transient + gathered weights and their grads
    transient: np.ndarray  # live values of the backward beyond saved activations
    time: np.ndarray  # compute seconds with the tensor all-reduces on the critical path
    compute_time: np.ndarray  # compute seconds alone
    tensor_bytes: np.ndarray  # bytes its tensor all-reduces send
    param_local: np.ndarray  # parameter bytes per device (per step, not per microbatch)
    param_gathered: np.ndarray  # the same once fsdp-gathered
    param_unsharded_fsdp: np.ndarray  # the part fsdp does not shard
    boundary: np.ndarray  # output activation bytes
    gathers: np.ndarray  # fsdp weight gathers per pass (2: forward and backward)
    fsdp_bytes: np.ndarray  # bytes its fsdp collectives send
    first_gather_bytes: np.ndarray  # one all-gather of its weights
    grads: np.ndarray  # its parameter gradients as the backward pass holds them (per step)
    cast: np.ndarray  # the narrow copies of its fsdp shards the step makes first (per step)
    matrices: np.ndarray  # param_local's float32 weight matrices fed to matmuls (not lookups)

    def row(self, i: int) -> dict[str, float]:
        """Layer ``i``'s entries as plain floats."""
        return {f.name: float(getattr(self, f.name)[i]) for f in dataclasses.fields(self)}

    def prefix(self, name: str) -> np.ndarray:
        """Prefix sums (length layers + 1) of field ``name``."""
        return np.concatenate([[0.0], np.cumsum(getattr(self, name))])


class Context:
    """Per-model, per-rules, per-profile state shared by every candidate (with caches).

    ``balance`` is how the executor cuts pipeline stages (``pipeline.balance``);
    ``compression`` how the data-axis gradient reduction is encoded; ``weights`` the
    configured fsdp weight-gather dtype (``compression.weights``) and ``compute_dtype`` the
    model's, which together decide what gathers and gradient reductions move;
    ``sequence_parallel`` is ``train.sequence_parallel`` (True, False or ``"auto"``).
    """

    def __init__(self, cost: ModelCost, profile: DeviceProfile, n_devices: int,
                 rules: Sequence = sharding.DEFAULT_RULES, balance: str = "flops",
                 compression: Compression | None = None, weights: str = "auto",
                 compute_dtype: str | None = None, sequence_parallel: bool | str = "auto",
                 master_weights: str = "auto"):
        self.cost = cost
        # a float32 master of 16-bit params (jaxmp.train.master): the master's bytes per
        # stored param byte (2 for bfloat16 params; 1: no master)
        self.master = master_weights_of(master_weights, cost)
        self.master_factor = 4.0 / itemsize(cost) if self.master != "none" else 1.0
        self.sequence_parallel = sequence_parallel
        self.compression = compression or Compression()
        # The data-axis gradient reduction's bytes relative to float32 (compression.gradients).
        self.grad_bytes_factor = bytes_factor(
            self.compression,
            list({leaf.path: (leaf.shape, leaf.names) for lay in cost.layers
                  for leaf in lay.params}.values()))
        self.weights, self.compute_dtype, self.profile = weights, compute_dtype, profile
        self.n, self.balance = n_devices, balance
        self.rules = sharding.normalize_rules(rules)
        layers = cost.layers
        groups: dict[str, int] = {}
        self.group_of = np.array([groups.setdefault(lay.group or lay.name, len(groups))
                                  for lay in layers], dtype=np.int64)
        self.first = [int(np.flatnonzero(self.group_of == g)[0]) for g in range(len(groups))]
        self.opt_ratio = np.array([lay.optimizer_bytes / lay.param_bytes if lay.param_bytes
                                   else 0.0 for lay in layers])
        share = min(profile.devices_per_host or n_devices, n_devices) if profile.shared_host \
            else 1
        self.peak = profile.peak_flops / share
        self.rate = self.peak * profile.efficiency  # achievable FLOP/s per device
        self.memory_limit = profile.memory_bytes * profile.usable_fraction / share
        pre = {leaf.path for leaf in layers[0].params} if layers else set()
        # A head with tied embeddings reads the embedding's weights: one copy on one stage.
        # Blocks' tensor collectives under SP as rings where the backend overlaps (sharding.ring)
        self.rings = cost.tensor_rings in (True, "auto") and profile.overlap
        self.kinds = np.array([lay.kind for lay in layers])  # "pre" / "layer" / "block" / "post"
        self.blocks = self.kinds == "block"
        self.tied = np.array([lay.kind == "post" and bool(lay.params)
                              and all(leaf.path in pre for leaf in lay.params) for lay in layers])
        self.span = stack_span([lay.kind for lay in layers],
                               [lay.group or lay.name for lay in layers])
        self.in_loop = np.array([bool(lay.in_loop) for lay in layers])
        self._shards: dict[tuple[int, int, int], LayerShard] = {}
        self._cache: dict[tuple, Any] = {}

    @property
    def n_blocks(self) -> int:
        """Blocks in the model's layer stack (0 without one)."""
        return self.span[1] - self.span[0] if self.span else 0

    def cached(self, key: tuple, make: Any) -> Any:
        """``make()``, computed once per ``key`` (the predictors' memo)."""
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def shard(self, i: int, fsdp: int, tensor: int) -> LayerShard:
        key = (int(self.group_of[i]), fsdp, tensor)
        if key not in self._shards:
            self._shards[key] = self._resolve(self.first[key[0]], fsdp, tensor)
        return self._shards[key]

    def wire_dtypes(self, fsdp: int) -> tuple[str, str]:
        """What fsdp's weight gathers and gradient reductions move on ``fsdp`` devices: the
        layout's ``gather_dtype`` and ``reduce_dtype``."""
        wire = gather_dtype(self.weights, self.compute_dtype, fsdp)
        return wire, reduce_dtype(wire, self.compute_dtype)

    def _resolve(self, i: int, fsdp: int, tensor: int) -> LayerShard:
        wire, reduce = self.wire_dtypes(fsdp)
        return resolve_shard(self.cost.layers[i], fsdp, tensor, self.rules, wire, reduce,
                             self.compute_dtype, self.profile.upcasts_16bit)

    def flops_per_step(self, remat: str) -> float:
        return self.cached(("flops", remat), lambda: self.cost.flops_per_step(remat))

    @property
    def seq_len(self) -> int | None:
        """The sequence length sequence parallelism could split (its activations name it)."""
        return self.cost.seq_len if SEQ in self.cost.activation_names else None

    def divisor(self, i: int, fsdp: int, tensor: int, sp: bool):
        """What splits layer ``i``'s saved values on this mesh (:func:`saved_divisor`)."""
        sh = self.shard(i, fsdp, tensor)
        return saved_divisor(sh.tensor_dims, tensor, (self.seq_len or 0) if sp else 0,
                             sh.tensor_names)

    def _saved_bytes(self, i: int, remat: str, fsdp: int, tensor: int, rows: float,
                     fused: bool, sp: bool = False, staged: bool = False) -> float:
        def split() -> tuple[float, float]:
            div = self.divisor(i, fsdp, tensor, sp)
            lay = self.cost.layers[i]
            saved = lay.fused.get(remat, lay.saved.get(remat)) if fused else lay.saved[remat]
            if staged:  # what a pipeline's stash keeps (jaxmp.pipeline.residuals)
                saved = lay.staged.get(remat, saved)
            const, per_row = saved.split(div, self.profile.upcasts_16bit)
            # A scan stores the row-independent residuals (its weights' compute-dtype casts)
            # split like the weights, and gathers them again for the backward pass.
            return (const / fsdp if lay.in_loop else const), per_row

        const, per_row = self.cached(("saved", i, remat, fsdp, tensor, fused, sp, staged),
                                     split)
        return const + per_row * rows

    def head_gradient(self, i: int, rows: float, fsdp: int, tensor: int, sp: bool) -> float:
        """The head's (layer ``i``'s) output gradient at ``rows``: its logits (plan.head)."""
        return self.cached(("head", rows, fsdp, tensor, sp), lambda: self.cost.layers[
            i].largest_value(rows, self.divisor(i, fsdp, tensor, sp), self.profile.upcasts_16bit))

    def _transient(self, i: int, remat: str, fsdp: int, tensor: int, rows: float,
                   io: float, sp: bool = False) -> float:
        """Peak extra bytes of layer i's backward pass at ``rows`` (jaxmp.cost.liveness)."""
        lay = self.cost.layers[i]
        if remat not in lay.transient:  # the root's code: its gradients mirror what it keeps,
            # less (GPUs) the loss gradient written over the logits (jaxmp.plan.head)
            in_place = self.head_gradient(i, rows, fsdp, tensor, sp) if lay.kind == "post" \
                and self.profile.holds_head_gradient else 0.0
            return 2 * io + self._saved_bytes(i, remat, fsdp, tensor, rows, True, sp) - in_place
        div = self.divisor(i, fsdp, tensor, sp)
        # With the sequence split, a matmul's activation operands and results stay whole
        # (gathered inputs, partial sums before the reduce-scatter; jaxmp.cost.liveness).
        whole = self.divisor(i, fsdp, tensor, False) if sp else None
        # GPUs hold the scores together (DeviceProfile.holds_scores): double-buffered or one
        # layer an iteration under jaxlib 0.12 (docs/planner.md §7 "Stop 36")
        base = lay.transient[remat]
        timeline = self.cached(("timeline", i, remat), lambda: base.held_together(
            self.cost.seq_len)) if self.profile.holds_scores else base
        sizes = self.cached(("transient", i, remat, fsdp, tensor, sp),
                            lambda: timeline.sizes(div, self.profile.upcasts_16bit, whole,
                                                   self.profile.reassociates_all_reduce))
        return timeline.peak_of(sizes, rows)

    def link_bw(self, sizes: dict[str, int]) -> dict[str, float]:
        """Bandwidth each axis's collectives run at (:func:`jaxmp.plan.links.link_bw`)."""
        return link_bw(self.profile, self.n, sizes)

    def table(self, remat: str, data: int, fsdp: int, tensor: int,
              microbatches: int, sp: bool = False, staged: bool = False) -> LayerTable:
        """The :class:`LayerTable` of one (remat, mesh, microbatches, sequence parallelism),
        computed once per group of identical layers and cached; ``staged``: run in a
        pipeline's ticks."""
        return self.cached(("table", remat, data, fsdp, tensor, microbatches, sp, staged),
                           lambda: self._table(remat, data, fsdp, tensor, microbatches, sp, staged))

    def _table(self, remat: str, data: int, fsdp: int, tensor: int,
               microbatches: int, sp: bool, staged: bool) -> LayerTable:
        cost = self.cost
        rows = cost.rows / (data * fsdp * microbatches)
        bw_tensor = self.link_bw({"data": data, "stage": 1, "fsdp": fsdp,
                                  "tensor": tensor})["tensor"]
        custom = self.wire_dtypes(fsdp)[0] == "int8"
        per_group = []
        for i in self.first:
            lay, sh = cost.layers[i], self.shard(i, fsdp, tensor)
            saved = self._saved_bytes(i, remat, fsdp, tensor, rows, not staged and stores_fused(
                self.profile, lay, remat, cost.seq_len), sp, staged)  # (the GPU's scans)
            act = self._saved_bytes(i, remat, fsdp, tensor, rows, True, sp) \
                if not lay.in_loop else saved
            io = max(lay.boundary_bytes, lay.input_bytes) * rows / cost.rows
            if self.profile.upcasts_16bit and lay.act_itemsize == 2:
                io *= 2
            transient = self._transient(i, remat, fsdp, tensor, rows, io, sp)
            # Outside a loop an fsdp-gathered weight is gathered once and kept for the backward
            # pass, unless remat re-runs the layer's matmuls (saving less than without one; not
            # "selective"): then it is gathered again. Inside a loop it is gathered again, unless
            # jaxmp gathers it (custom) without remat: the scan keeps the gathered copy.
            rematted = not keeps_layer(remat) and {remat, "none"} <= set(lay.saved) \
                and lay.saved[remat].bytes < lay.saved["none"].bytes
            regather = rematted or (lay.in_loop and not (custom and keeps_layer(remat)))
            # (the pre code takes no input gradient: its backward reads no gathered weight)
            kept = 0.0 if regather or lay.kind == "pre" else sh.gather_wire
            # Time: the FLOPs the device runs (less what causal kernels skip) at the
            # achievable rate (weight matmuls at their width's, jaxmp.plan.gemm), plus the
            # memory-bound work at the memory bandwidth: the saved
            # activations written in the forward and read back in the backward, and from the
            # program's count (jaxmp.cost.traffic) the thin matmuls' bytes beyond their FLOPs and
            # the fusions of XLA's attention (of the embedding / head / loss: all of them;
            # a block's other fusions are in the efficiency; docs/planner.md §2, §4).
            split = tensor if sh.tensor_dims else 1
            flops = lay.run_flops(remat) * rows / cost.rows / split
            bw = self.profile.memory_bw
            traffic = lay.traffic.get(remat)
            seconds = compute_seconds(flops, traffic, rows, split, self.profile,
                                      self.peak, self.rate) + (2 * act / bw if bw else 0.0) + (
                traffic.seconds(rows, split, self.rate, bw, fused=lay.kind in ("pre", "post"))
                if traffic is not None else 0.0)
            # Full remat recomputes the forward, with its row-parallel all-reduces (all but the
            # last: the layer's own output is not needed again); so does a policy keeping no
            # more than full (a name-based one on a model without names, jaxmp.remat).
            recomputes_all = remat == "full" or rematted and "full" in lay.saved \
                and lay.saved[remat].bytes <= lay.saved["full"].bytes
            # (A tied head reads the embedding's table transposed: its rows are columns.)
            row = sh.tensor_weights - sh.row_parallel if self.tied[i] else sh.row_parallel
            column = sh.tensor_weights - row  # their input gradients: all-reduced
            inputs = min(column, max(row, 1))  # distinct inputs of the column-parallel ones
            backward = inputs if self.profile.reassociates_all_reduce else column  # devices.py
            # (A pipeline's ticks send these once a microbatch each way: stop 28 charged the
            # GPU's staged backward a forward's row all-reduces again, but that was the judge
            # counting the folded last chunk's forward twice, §7 "Stop 30".)
            n_all_reduce = row + backward + (max(0, row - 1) if recomputes_all else 0)
            # A vocab-split lookup's all-reduce sums the table's rows before the cast to the
            # compute dtype: in the table's dtype (the step's 16-bit copy if fsdp makes one).
            wide = sh.row_itemsize / lay.act_itemsize if lay.kind == "pre" and row \
                and not self.profile.upcasts_16bit and not sh.cast else 1.0
            tensor_bytes = n_all_reduce * 2 * (tensor - 1) / tensor * io * max(1.0, wide) \
                if tensor > 1 else 0.0
            tensor_bytes += regather_bytes(inputs, io, sp=sp, tensor=tensor,
                                           reassociates=self.profile.reassociates_all_reduce)
            # A tied head computes with the table the lookup gathered: no gather of its own.
            gathers = 0.0 if self.tied[i] else 2.0 if regather else 1.0
            reduced, grad_held = (fsdp - 1) / fsdp * sh.reduce_wire, sh.reduce_wire
            if lay.kind == "pre" and cost.sharded_lookup and not staged:  # (ticks: pipeline.py)
                reduced, grad_held = lookup_wire_bytes(fsdp, io, rows * cost.seq_len), sh.local
            fsdp_bytes = (fsdp - 1) / fsdp * (gathers * sh.gather_wire + 2 * sh.unsharded_fsdp) \
                + reduced if fsdp > 1 else 0.0
            first_gather = (fsdp - 1) / fsdp * sh.gather_wire if fsdp > 1 else 0.0
            # A layer's backward holds its gathered weights and their gradients whole (wire dtypes)
            per_group.append((act + kept, saved,
                              transient + grad_held + (sh.gather_wire if regather else 0.0),
                              transient, seconds + tensor_bytes / bw_tensor,
                              seconds, tensor_bytes, sh.local, sh.gathered,
                              sh.unsharded_fsdp, lay.boundary_bytes * rows / cost.rows, gathers,
                              fsdp_bytes, first_gather, sh.grads, sh.cast, sh.matrices))
        columns = np.array(per_group, dtype=np.float64)[self.group_of]
        return LayerTable(*(columns[:, j] for j in range(columns.shape[1])))

    def split(self, remat: str, stages: int, virtual: int) -> StageSplit:
        """The executor's stage split of this model: the folded per-layer table (``pre``, each
        block, ``post``) cut by training FLOPs at ``remat`` (or layer count: ``balance``)."""
        def make() -> StageSplit:
            return split_layers(fold([lay.flops(remat) for lay in self.cost.layers], self.span),
                                stages, virtual, self.balance)

        return self.cached(("split", remat, stages, virtual), make)

    def layout(self, sizes: Mapping[str, int], remat: str, microbatches: int,
               schedule: str = "", virtual: int = 1, optimizer: str = "none",
               sp: bool | None = None) -> Layout:
        """The complete :class:`~jaxmp.plan.layout.Layout` of one candidate: its stage split,
        data-reduction decision, gather dtype, compression and sequence parallelism derived
        here, once; ``optimizer``: the optimizer-state sharding tried (``"none"`` without a
        data axis); ``sp``: sequence parallelism as tried (None: as configured)."""
        stages = int(sizes.get("stage", 1))
        compression = effective_compression(self.compression, int(sizes.get("data", 1)))
        wire, reduce = self.wire_dtypes(int(sizes.get("fsdp", 1)))
        return Layout(mesh_items(sizes), remat, microbatches, schedule if stages > 1 else "",
                      virtual if stages > 1 else 1,
                      self.split(remat, stages, virtual) if stages > 1 else None,
                      reduction(sizes, compression, microbatches), wire, compression,
                      reduce_dtype=reduce,
                      optimizer_sharding=self.optimizer_sharding(optimizer, sizes),
                      sequence_parallel=(self.sp_choices(sizes)[-1]
                                         if sp is None else sp),
                      master_weights=self.master)

    def sp_choices(self, sizes: Mapping[str, int]) -> tuple[bool, ...]:
        """The sequence parallelism the search tries on a mesh of ``sizes``
        (:func:`jaxmp.plan.sequence.choices`), inside pipeline stages and gradient
        accumulation loops too (their GPU programs send what is predicted: docs/planner.md
        §7, stop 35). An explicit ``true`` is built and predicted."""
        fsdp, tensor = int(sizes.get("fsdp", 1)), int(sizes.get("tensor", 1))
        every = all(self.shard(i, fsdp, tensor).tensor_weights
                    == self.shard(i, fsdp, tensor).n_matrices
                    for i in self.first if self.cost.layers[i].kind == "block")
        return sequence_choices(self.sequence_parallel, tensor, self.seq_len, every)

    def optimizer_sharding(self, tried: str, sizes: Mapping[str, int]) -> str:
        """The optimizer-state sharding a candidate builds: ``tried``, except ``"data"``
        where no parameter has a dim whose local size ``data`` divides — the Trainer's
        :func:`jaxmp.train.zero.built` then finds nothing cut and builds ``"none"``."""
        data = int(sizes.get("data", 1))
        chosen = optimizer_sharding(tried, data)
        if chosen != "data":
            return chosen
        fsdp, tensor = int(sizes.get("fsdp", 1)), int(sizes.get("tensor", 1))
        return "data" if self.cached(("data_cut", data, fsdp, tensor),
                                     lambda: self._data_cuts(data, fsdp, tensor)) else "none"

    def _data_cuts(self, data: int, fsdp: int, tensor: int) -> bool:
        sizes = {"data": data, "stage": 1, "fsdp": fsdp, "tensor": tensor}
        # a stack's blocks share their leaves: each (names, shape) resolved once
        for names, shape in {(x.names, x.shape): x for lay in self.cost.layers
                             for x in lay.params}:
            spec = sharding.resolve(names, shape, sizes, self.rules).spec \
                if names is not None else ()
            if data_dim(spec, shape, sizes) is not None:
                return True
        return False

    def outside_stack(self, fsdp: int, tensor: int) -> tuple[float, float]:
        """Parameter and optimizer bytes per device of the layers outside the layer stack
        (embedding, head, final norm; tied weights once): what every pipeline stage holds."""
        def sums() -> tuple[float, float]:
            own = np.where(self.tied, 0.0, self.table("none", 1, fsdp, tensor, 1).param_local)
            outside = np.ones(len(own), bool)
            outside[slice(*self.span) if self.span is not None else slice(0, 0)] = False
            return float(own[outside].sum()), float((own * self.opt_ratio)[outside].sum())

        return self.cached(("outside", fsdp, tensor), sums)


def zero_divisor(layout: Layout) -> int:
    """What the optimizer state and its update are divided by beyond the params' sharding:
    ``data`` when it is sharded over data (:mod:`jaxmp.train.zero`), else 1."""
    return layout.sizes.get("data", 1) if layout.optimizer_sharding == "data" else 1
