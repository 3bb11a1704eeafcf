"""Predict one candidate layout: per-device memory, FLOPs, bytes on each mesh axis, step time.

Everything is per device and per step, from the per-layer costs (:mod:`jaxmp.cost`), the
sharding rules resolved on the candidate mesh, and the device profile:

* **memory**: parameters and Adam state as the rules shard them (pipeline stages hold only
  their layers); gradients and the optimizer's update, each the size of the parameters; saved
  activations of every layer at the device's rows, times the microbatches in flight (1F1B:
  stage s holds ``min(stages - s, microbatches)``); and the working set of the largest layer's
  backward pass: recomputed activations, activation gradients, and under fsdp its gathered
  weights and their full-size gradients. Activations whose dims match a tensor-split weight
  dim are divided by the tensor axis, the rest are replicated over it.
* **communication**, ring formulas, bytes each device sends: ``data`` all-reduces gradients,
  2(N-1)/N·S; ``fsdp`` all-gathers weights (forward, and again in the backward pass of a
  scanned stack) and reduce-scatters gradients, (N-1)/N·S each, per microbatch; ``tensor``
  all-reduces a layer's activations once per tensor-split weight matrix (forward for
  row-parallel, backward for column-parallel ones), per microbatch; ``stage`` sends each
  microbatch's boundary activations forward and their gradients back.
* **time**: FLOPs / peak, plus each axis's bytes over its link (inside a host or across),
  plus the pipeline bubble (stages - 1) × the slowest stage's microbatch time. No overlap.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from jaxmp import sharding
from jaxmp.cost import ModelCost
from jaxmp.devices import DeviceProfile
from jaxmp.mesh import AXES
from jaxmp.parallel.balance import InfeasibleError, balance_stages
from jaxmp.parallel.reduce import Compression, bytes_factor

STEP_STATE_BYTES = 4  # the step counter of the train state


@dataclass(frozen=True)
class Layout:
    """One candidate: mesh axis sizes, remat policy and microbatches per step."""

    mesh: tuple[tuple[str, int], ...]
    remat: str
    microbatches: int

    @property
    def sizes(self) -> dict[str, int]:
        return dict(self.mesh)


@dataclass
class Prediction:
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
    comm_s: dict[str, float]
    comm_bytes: dict[str, float]  # bytes each device sends per step, by mesh axis
    step_time_s: float
    stages: list[tuple[int, int]]
    stage_time_s: list[float] = field(default_factory=list)

    @property
    def comm_bytes_per_step(self) -> float:
        return sum(self.comm_bytes.values())

    def to_dict(self) -> dict[str, Any]:
        return {"per_device_bytes": self.per_device_bytes, "argument_bytes": self.argument_bytes,
                "param_bytes": self.param_bytes, "optimizer_bytes": self.optimizer_bytes,
                "grad_bytes": self.grad_bytes, "activation_bytes": self.activation_bytes,
                "working_bytes": self.working_bytes, "step_time_s": self.step_time_s,
                "compute_s": self.compute_s, "bubble_s": self.bubble_s,
                "comm_s": dict(self.comm_s), "flops_per_step": self.flops_per_step,
                "flops_per_device": self.flops_per_device,
                "comm_bytes_per_step": self.comm_bytes_per_step,
                "comm_bytes_by_axis": dict(self.comm_bytes), "stage_time_s": self.stage_time_s}


@dataclass(frozen=True)
class _Shard:
    """One layer's parameters on one mesh: bytes per device and what the axes do to them."""

    local: float  # bytes per device
    gathered: float  # bytes per device once fsdp-gathered
    unsharded_f: float  # bytes fsdp does not shard (their gradients all-reduce over fsdp)
    tensor_weights: int  # matrices split by tensor
    row_parallel: int  # of those, split on their input dim (their output is all-reduced)
    tensor_dims: frozenset[int]  # sizes of dims split by tensor (to spot split activations)


class Context:
    """Per-model, per-rules, per-profile state shared by every candidate (with caches)."""

    def __init__(self, cost: ModelCost, profile: DeviceProfile, n_devices: int,
                 rules: Sequence = sharding.DEFAULT_RULES,
                 grad_compression: Compression | None = None):
        self.cost = cost
        # The data-axis gradient reduction's bytes relative to float32 (train.grad_compression).
        self.grad_compression = grad_compression or Compression()
        arrays = {leaf.path: (leaf.shape, leaf.names) for lay in cost.layers
                  for leaf in lay.params}
        self.grad_bytes_factor = bytes_factor(self.grad_compression, list(arrays.values()))
        self.profile = profile
        self.n = n_devices
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
        self.memory_limit = profile.memory_bytes * profile.usable_fraction / share
        pre = {leaf.path for leaf in layers[0].params} if layers else set()
        # A head with tied embeddings reads the embedding's weights: one copy on one stage.
        self.tied = np.array([lay.kind == "post" and bool(lay.params)
                              and all(leaf.path in pre for leaf in lay.params) for lay in layers])
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
        """Per-layer quantities of one (remat, mesh, microbatches), computed once per group."""
        key = (remat, d, f, t, m)
        if key in self._arrays:
            return self._arrays[key]
        cost = self.cost
        rows = cost.rows / (d * f * m)
        bw_t = self.link_bw({"data": d, "stage": 1, "fsdp": f, "tensor": t})["tensor"]
        per_group = []
        for i in self.first:
            lay, sh = cost.layers[i], self.shard(i, f, t)
            act = self._saved_bytes(i, remat, f, t, rows, fused=not lay.in_loop)
            io = max(lay.boundary_bytes, lay.input_bytes) * rows / cost.rows
            if self.profile.upcasts_16bit and lay.act_itemsize == 2:
                io *= 2
            work = self._transient(i, remat, f, t, rows, io) + 2 * (sh.gathered - sh.local)
            # Outside a loop an fsdp-gathered weight is gathered once and kept for the
            # backward pass, unless remat recomputes the layer (then it is gathered again).
            regather = lay.in_loop or remat != "none"
            kept = 0.0 if regather else sh.gathered - sh.local
            flops = lay.flops(remat) * rows / cost.rows / (t if sh.tensor_dims else 1)
            # Full remat recomputes the forward, with its row-parallel all-reduces (all but the
            # last: the layer's own output is not needed again).
            n_ar = sh.tensor_weights + (max(0, sh.row_parallel - 1) if remat == "full" else 0)
            tp = n_ar * 2 * (t - 1) / t * io if t > 1 else 0.0
            per_group.append((act + kept, work, flops / self.peak + tp / bw_t,
                              flops / self.peak, tp, sh.local, sh.gathered, sh.unsharded_f,
                              lay.boundary_bytes * rows / cost.rows, 2.0 if regather else 1.0))
        names = ("act", "work", "mb_time", "flop_time", "tp", "local", "gathered",
                 "unsharded_f", "boundary", "gathers")
        table = np.array(per_group, dtype=np.float64)[self.group_of]
        out = {name: table[:, j] for j, name in enumerate(names)}
        self._arrays[key] = out
        return out


def _saved_divisor(tdims: frozenset[int], t: int):
    def divisor(shape: tuple, bdim: int | None) -> int:
        if t <= 1:
            return 1
        hit = any(s in tdims and s % t == 0 for dim, s in enumerate(shape) if dim != bdim)
        return t if hit else 1

    return divisor


def predict(ctx: Context, layout: Layout, stages: list[tuple[int, int]] | None = None
            ) -> Prediction:
    """Predict ``layout``; with ``stage`` > 1 the stages are balanced here unless given.

    Raises :class:`InfeasibleError` when the stages cannot be balanced within memory.
    """
    cost = ctx.cost
    s = layout.sizes
    d, p, f, t, m = s["data"], s["stage"], s["fsdp"], s["tensor"], layout.microbatches
    n_layers = len(cost.layers)
    a = ctx.arrays(layout.remat, d, f, t, m)
    own = np.where(ctx.tied, 0.0, a["local"])  # stored once, by the embedding's stage
    if p > 1 and stages is None:
        # Per-layer memory of the first stage (the most microbatches in flight); the working
        # set and the batch are per stage, so they come off the limit.
        per_layer = own * (3 + ctx.opt_ratio) + a["act"] * min(p, m)
        room = max(0.0, ctx.memory_limit - float(a["work"].max()) - cost.batch_bytes / (d * f))
        # The split that only balances time is the same for every data size and microbatch
        # count (per-layer times all scale with the rows); when it also fits in memory it is
        # optimal, else balance again under the memory limit.
        key = ("stages", layout.remat, f, t, p)
        if key not in ctx._saved:
            ctx._saved[key] = balance_stages(a["mb_time"], p)
        stages = ctx._saved[key]
        if max(float(per_layer[lo:hi].sum()) for lo, hi in stages) > room:
            stages = balance_stages(a["mb_time"], p, memory_limit=room, memory=per_layer)
    stages = [tuple(x) for x in (stages or [(0, n_layers)])]

    first = np.array([lo for lo, _ in stages])
    last = np.array([hi for _, hi in stages])

    def per_stage(x: np.ndarray) -> np.ndarray:
        c = np.concatenate([[0.0], np.cumsum(x)])
        return c[last] - c[first]

    # The head's own copy of tied weights when it sits on another stage than the embedding.
    apart = ctx.tied & (np.repeat(first, last - first) > 0)
    stored = own + np.where(apart, a["local"], 0.0)
    params_s = per_stage(stored)
    opt_s = per_stage(stored * ctx.opt_ratio)
    k_idx = np.arange(len(stages))
    in_flight = np.minimum(p - k_idx, m) if p > 1 else np.ones(len(stages))
    acts_s = in_flight * per_stage(a["act"])
    working_s = np.maximum.reduceat(a["work"], first)
    batch_s = np.where((k_idx == 0) | (k_idx == len(stages) - 1),
                       cost.batch_bytes / (d * f), 0.0)
    args_s = params_s + opt_s + batch_s + STEP_STATE_BYTES
    # The gradients and the optimizer's update, both parameter-sized; accumulating over
    # microbatches adds the running sum.
    grads_s = (3 if m > 1 else 2) * params_s
    total_s = args_s + grads_s + acts_s + working_s
    k_worst = int(np.argmax(total_s))
    total, params, opt, grads, acts, working, batch, args = (
        float(x[k_worst]) for x in (total_s, params_s, opt_s, grads_s, acts_s, working_s,
                                    batch_s, args_s))
    stage_time = per_stage(a["mb_time"]).tolist()
    stage_flop_time = per_stage(a["flop_time"]).tolist()
    lo, hi = stages[k_worst]

    comm = dict.fromkeys(AXES, 0.0)
    comm["tensor"] = m * float(a["tp"][lo:hi].sum())
    if f > 1:
        sharded = a["gathered"][lo:hi] - a["unsharded_f"][lo:hi]
        gathers = a["gathers"][lo:hi]
        comm["fsdp"] = m * (f - 1) / f * float(((gathers + 1) * sharded).sum()
                                                + 2 * a["unsharded_f"][lo:hi].sum())
    if d > 1:  # once per step (jaxmp.parallel.reduce), encoded per train.grad_compression;
        # an uncompressed pipeline reduces inside its schedule, once per microbatch
        times = m if p > 1 and ctx.grad_compression.kind == "none" else 1
        comm["data"] = (times * ctx.grad_bytes_factor * 2 * (d - 1) / d
                        * float(a["local"][lo:hi].sum()))
    if p > 1:
        sends = (k_worst < len(stages) - 1) + (k_worst > 0)
        comm["stage"] = m * sends * float(a["boundary"][hi - 1])
    bw = ctx.link_bw(s)
    comm_s = {axis: comm[axis] / bw[axis] for axis in AXES}
    k_slow = int(np.argmax(stage_time))
    slowest = stage_time[k_slow]
    compute, bubble = m * stage_flop_time[k_slow], (p - 1) * slowest
    comm_s["tensor"] = m * (slowest - stage_flop_time[k_slow])  # on the critical path
    step = m * slowest + bubble + sum(v for axis, v in comm_s.items() if axis != "tensor")
    flops_step = ctx.flops_per_step(layout.remat)
    return Prediction(
        param_bytes=params, optimizer_bytes=opt, grad_bytes=grads, activation_bytes=acts,
        working_bytes=working, batch_bytes=batch, argument_bytes=args, per_device_bytes=total,
        flops_per_step=flops_step, flops_per_device=flops_step / ctx.n, compute_s=compute,
        bubble_s=bubble, comm_s=comm_s, comm_bytes=comm, step_time_s=step,
        stages=[(int(x), int(y)) for x, y in stages], stage_time_s=[m * x for x in stage_time])


__all__ = ["Context", "Layout", "Prediction", "predict", "InfeasibleError"]
