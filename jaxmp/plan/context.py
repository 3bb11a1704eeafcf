"""What every candidate layout shares: the model's per-layer costs resolved on a mesh.

:class:`Context` holds a model's costs, the device profile and the rules, and computes — once
per (remat, mesh shape, microbatches), cached — the per-layer arrays both predictors
(:mod:`jaxmp.plan.predict` without pipeline stages, :mod:`jaxmp.plan.pipeline` with them)
sum: parameter bytes as the rules shard them, saved activations at a device's rows, each
layer's backward working set, its compute time at the profile's achievable rate and the
bytes its tensor-parallel all-reduces move.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from jaxmp import sharding
from jaxmp.compression.reduce import Compression, bytes_factor
from jaxmp.cost import ModelCost
from jaxmp.devices import DeviceProfile
from jaxmp.mesh import AXES
from jaxmp.pipeline.footprint import stack_span

STEP_STATE_BYTES = 4  # the step counter of the train state


@dataclass(frozen=True)
class Layout:
    """One candidate: mesh axis sizes, remat policy, microbatches per step and, with pipeline
    stages, the schedule and its virtual stages (chunks per device)."""

    mesh: tuple[tuple[str, int], ...]
    remat: str
    microbatches: int
    schedule: str = "1f1b"
    virtual: int = 1

    @property
    def sizes(self) -> dict[str, int]:
        return dict(self.mesh)


@dataclass
class Prediction:
    """Per device and per step. Memory terms sum to ``per_device_bytes``; time terms (compute,
    bubble, the exposed communication of each axis) sum to ``step_time_s``."""

    param_bytes: float
    optimizer_bytes: float
    grad_bytes: float
    activation_bytes: float
    working_bytes: float
    batch_bytes: float
    argument_bytes: float
    per_device_bytes: float  # peak: arguments + temporaries
    flops_per_step: float  # the whole step, all devices
    flops_per_device: float
    compute_s: float
    bubble_s: float
    comm_s: dict[str, float]  # exposed: what each axis adds to the step
    comm_bytes: dict[str, float]  # bytes each device sends per step, by mesh axis
    step_time_s: float
    stages: list[tuple[int, int]]
    stage_time_s: list[float] = field(default_factory=list)
    comm_hidden_s: dict[str, float] = field(default_factory=dict)  # overlapped with compute
    working_parts: dict[str, float] = field(default_factory=dict)  # what the working set is
    activation_parts: dict[str, float] = field(default_factory=dict)
    schedule: str = ""  # with stages: the pipeline schedule
    virtual: int = 1
    blocks_per_chunk: list[int] = field(default_factory=list)

    @property
    def comm_bytes_per_step(self) -> float:
        return sum(self.comm_bytes.values())

    def to_dict(self) -> dict[str, Any]:
        return {"per_device_bytes": self.per_device_bytes, "argument_bytes": self.argument_bytes,
                "param_bytes": self.param_bytes, "optimizer_bytes": self.optimizer_bytes,
                "grad_bytes": self.grad_bytes, "activation_bytes": self.activation_bytes,
                "working_bytes": self.working_bytes, "batch_bytes": self.batch_bytes,
                "working_parts": dict(self.working_parts),
                "activation_parts": dict(self.activation_parts),
                "step_time_s": self.step_time_s, "compute_s": self.compute_s,
                "bubble_s": self.bubble_s, "comm_s": dict(self.comm_s),
                "comm_hidden_s": dict(self.comm_hidden_s),
                "flops_per_step": self.flops_per_step, "flops_per_device": self.flops_per_device,
                "comm_bytes_per_step": self.comm_bytes_per_step,
                "comm_bytes_by_axis": dict(self.comm_bytes), "stage_time_s": self.stage_time_s,
                "schedule": self.schedule, "virtual_stages": self.virtual,
                "blocks_per_chunk": list(self.blocks_per_chunk)}


@dataclass(frozen=True)
class _Shard:
    """One layer's parameters on one mesh: bytes per device and what the axes do to them."""

    local: float  # bytes per device
    gathered: float  # bytes per device once fsdp-gathered
    unsharded_f: float  # bytes fsdp does not shard (their gradients all-reduce over fsdp)
    tensor_weights: int  # matrices split by tensor
    row_parallel: int  # of those, split on their input dim (their output is all-reduced)
    tensor_dims: frozenset[int]  # sizes of dims split by tensor (to spot split activations)


# Per-layer columns of Context.arrays (per device, per microbatch unless noted).
COLUMNS = ("act", "saved", "work", "transient", "mb_time", "flop_time", "tp", "local", "gathered",
           "unsharded_f", "boundary", "gathers", "fsdp", "gather1")


class Context:
    """Per-model, per-rules, per-profile state shared by every candidate (with caches).

    ``balance`` is how the executor cuts pipeline stages (``pipeline.balance``);
    ``grad_compression`` how the data-axis gradient reduction is encoded.
    """

    def __init__(self, cost: ModelCost, profile: DeviceProfile, n_devices: int,
                 rules: Sequence = sharding.DEFAULT_RULES, balance: str = "flops",
                 grad_compression: Compression | None = None):
        self.cost = cost
        # The data-axis gradient reduction's bytes relative to float32 (compression.gradients).
        self.grad_compression = grad_compression or Compression()
        self.grad_bytes_factor = bytes_factor(
            self.grad_compression,
            list({leaf.path: (leaf.shape, leaf.names) for lay in cost.layers
                  for leaf in lay.params}.values()))
        self.profile = profile
        self.n = n_devices
        self.rules = sharding.normalize_rules(rules)
        self.balance = balance
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
        self.tied = np.array([lay.kind == "post" and bool(lay.params)
                              and all(leaf.path in pre for leaf in lay.params) for lay in layers])
        self.span = stack_span([lay.kind for lay in layers],
                               [lay.group or lay.name for lay in layers])
        self._shards: dict[tuple[int, int, int], _Shard] = {}
        self._saved: dict[tuple, Any] = {}
        self._arrays: dict[tuple, dict[str, np.ndarray]] = {}

    def shard(self, i: int, f: int, t: int) -> _Shard:
        key = (int(self.group_of[i]), f, t)
        if key not in self._shards:
            self._shards[key] = self._resolve(self.first[key[0]], f, t)
        return self._shards[key]

    def _resolve(self, i: int, f: int, t: int) -> _Shard:
        lay = self.cost.layers[i]
        sizes = {"data": 1, "stage": 1, "fsdp": f, "tensor": t}
        local = gathered = unsharded_f = 0.0
        weights = rows = 0
        tdims: set[int] = set()
        for leaf in lay.params:
            spec = sharding.resolve(leaf.names, leaf.shape, sizes, self.rules).spec \
                if leaf.names is not None else ()
            axes = [a for e in spec for a in ((e,) if isinstance(e, str) else (e or ()))]
            div = math.prod(sizes[a] for a in axes)
            nb = leaf.nbytes * lay.share
            local += nb / div
            gathered += nb / (div // f if "fsdp" in axes else div)
            unsharded_f += 0.0 if "fsdp" in axes else nb / div
            split = [d for d, e in enumerate(spec)
                     if e == "tensor" or (isinstance(e, tuple) and "tensor" in e)]
            tdims.update(int(leaf.shape[d]) for d in split)
            dims = [d for d, n in enumerate(leaf.names or ()) if n != "layers"]
            weights += bool(split) and len(dims) >= 2
            rows += len(dims) >= 2 and dims[0] in split
        return _Shard(local, gathered, unsharded_f, weights, rows, frozenset(tdims))

    def flops_per_step(self, remat: str) -> float:
        key = ("flops", remat)
        if key not in self._saved:
            self._saved[key] = self.cost.flops_per_step(remat)
        return self._saved[key]

    def _saved_bytes(self, i: int, remat: str, f: int, t: int, rows: float,
                     fused: bool) -> float:
        key = (i, remat, f, t, fused)
        if key not in self._saved:
            div = _saved_divisor(self.shard(i, f, t).tensor_dims, t)
            lay = self.cost.layers[i]
            saved = lay.fused.get(remat, lay.saved.get(remat)) if fused else lay.saved[remat]
            self._saved[key] = saved.split(div, self.profile.upcasts_16bit)
        const, per_row = self._saved[key]
        return const + per_row * rows

    def _transient(self, i: int, remat: str, f: int, t: int, rows: float, io: float) -> float:
        """Peak extra bytes of layer i's backward pass at ``rows`` (jaxmp.cost.liveness)."""
        lay = self.cost.layers[i]
        if remat not in lay.transient:  # the root's code: its gradients mirror what it saved
            return 2 * io + self._saved_bytes(i, remat, f, t, rows, fused=False)
        key = ("transient", i, remat, f, t)
        if key not in self._saved:
            div = _saved_divisor(self.shard(i, f, t).tensor_dims, t)
            self._saved[key] = lay.transient[remat].sizes(div, self.profile.upcasts_16bit)
        return lay.transient[remat].peak_of(self._saved[key], rows)

    def link_bw(self, sizes: dict[str, int]) -> dict[str, float]:
        """Bandwidth each axis's collectives run at: inside a host, or across hosts."""
        per_host = self.profile.devices_per_host or self.n
        out, inner = {}, 1
        for axis in reversed(AXES):  # tensor innermost ... data outermost
            inner *= sizes[axis]
            out[axis] = self.profile.intra_host_bw if inner <= per_host \
                else self.profile.inter_host_bw
        return out

    def arrays(self, remat: str, d: int, f: int, t: int, m: int) -> dict[str, np.ndarray]:
        """Per-layer quantities of one (remat, mesh, microbatches), computed once per group.

        Columns (per device, one microbatch of ``rows / (d·f·m)`` rows): ``act`` activations
        kept for the backward pass as the layer runs (fused outside a loop), ``saved`` as a
        scan stores them, ``work`` the backward working set (``transient`` plus the fsdp-gathered
        weights and their gradients), ``mb_time`` / ``flop_time`` compute time with / without
        its tensor-parallel all-reduces (``tp`` bytes), parameter bytes (``local``,
        ``gathered``, ``unsharded_f``), ``boundary`` output bytes, ``gathers`` per pass,
        ``fsdp`` bytes its fsdp collectives send, ``gather1`` one all-gather's bytes.
        """
        key = (remat, d, f, t, m)
        if key in self._arrays:
            return self._arrays[key]
        cost = self.cost
        rows = cost.rows / (d * f * m)
        bw_t = self.link_bw({"data": d, "stage": 1, "fsdp": f, "tensor": t})["tensor"]
        per_group = []
        for i in self.first:
            lay, sh = cost.layers[i], self.shard(i, f, t)
            saved = self._saved_bytes(i, remat, f, t, rows, fused=False)
            act = self._saved_bytes(i, remat, f, t, rows, fused=True) if not lay.in_loop \
                else saved
            io = max(lay.boundary_bytes, lay.input_bytes) * rows / cost.rows
            if self.profile.upcasts_16bit and lay.act_itemsize == 2:
                io *= 2
            transient = self._transient(i, remat, f, t, rows, io)
            # Outside a loop an fsdp-gathered weight is gathered once and kept for the
            # backward pass, unless remat recomputes the layer (then it is gathered again).
            regather = lay.in_loop or remat != "none"
            kept = 0.0 if regather else sh.gathered - sh.local
            flops = lay.flops(remat) * rows / cost.rows / (t if sh.tensor_dims else 1)
            # Full remat recomputes the forward, with its row-parallel all-reduces (all but the
            # last: the layer's own output is not needed again).
            n_ar = sh.tensor_weights + (max(0, sh.row_parallel - 1) if remat == "full" else 0)
            tp = n_ar * 2 * (t - 1) / t * io if t > 1 else 0.0
            gathers = 2.0 if regather else 1.0
            sharded = sh.gathered - sh.unsharded_f
            fsdp = (f - 1) / f * ((gathers + 1) * sharded + 2 * sh.unsharded_f) if f > 1 else 0.0
            gather1 = (f - 1) / f * sharded if f > 1 else 0.0
            per_group.append((act + kept, saved, transient + 2 * (sh.gathered - sh.local),
                              transient, flops / self.rate + tp / bw_t, flops / self.rate, tp,
                              sh.local, sh.gathered, sh.unsharded_f,
                              lay.boundary_bytes * rows / cost.rows, gathers, fsdp, gather1))
        table = np.array(per_group, dtype=np.float64)[self.group_of]
        out = {name: table[:, j] for j, name in enumerate(COLUMNS)}
        self._arrays[key] = out
        return out

    def prefix(self, remat: str, d: int, f: int, t: int, m: int) -> dict[str, np.ndarray]:
        """Prefix sums (length layers + 1) of the time and traffic columns of :meth:`arrays`."""
        key = ("prefix", remat, d, f, t, m)
        if key not in self._saved:
            a = self.arrays(remat, d, f, t, m)
            self._saved[key] = {k: np.concatenate([[0.0], np.cumsum(a[k])])
                                for k in ("mb_time", "flop_time", "tp", "fsdp")}
        return self._saved[key]

    def outside_stack(self, remat: str, d: int, f: int, t: int, m: int) -> tuple[float, float]:
        """Parameter and optimizer bytes per device of the layers outside the layer stack
        (embedding, head, final norm; tied weights once): what every pipeline stage holds."""
        key = ("outside", f, t)
        if key not in self._saved:
            a = self.arrays(remat, d, f, t, m)
            own = np.where(self.tied, 0.0, a["local"])
            outside = np.ones(len(own), bool)
            if self.span is not None:
                outside[self.span[0]:self.span[1]] = False
            self._saved[key] = (float(own[outside].sum()),
                                float((own * self.opt_ratio)[outside].sum()))
        return self._saved[key]


def _saved_divisor(tdims: frozenset[int], t: int):
    def divisor(shape: tuple, bdim: int | None) -> int:
        if t <= 1:
            return 1
        hit = any(s in tdims and s % t == 0 for dim, s in enumerate(shape) if dim != bdim)
        return t if hit else 1

    return divisor


def overlapped(comm: np.ndarray, compute: np.ndarray, first: float, overlap: bool
               ) -> tuple[float, float]:
    """``(exposed, hidden)`` seconds of per-layer collectives ``comm`` beside per-layer
    ``compute``, as XLA's latency-hiding scheduler runs them: layer i's collectives (gathering
    the next layer's weights, reducing its own gradients) run while a layer computes, so only
    what is longer than that compute shows, plus ``first`` — the first weight gather, which
    nothing precedes. Without ``overlap`` (the CPU backend) everything shows."""
    total = float(comm.sum())
    if not overlap:
        return total, 0.0
    exposed = min(total, float(np.maximum(comm - compute, 0.0).sum()) + first)
    return exposed, total - exposed
