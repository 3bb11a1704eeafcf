"""Pipeline schedules — GPipe, 1F1B, interleaved 1F1B — as tick tables, with their closed forms.

One description serves the planner (ticks, bubble, microbatches in flight) and the executor
(:mod:`jaxmp.pipeline.executor`, which runs :meth:`Schedule.program`), so they cannot drift apart;
the tests check the closed forms against the simulated tables.

**The model of time.** jaxmp runs a pipeline inside one SPMD program (``jax.shard_map`` over the
``stage`` axis), so devices advance in lockstep *ticks*; between ticks activations move one
device forward and cotangents one device back (``ppermute``). In one tick a device does at most
one forward (F) and one backward (B), each of one microbatch on one of its chunks. A chunk is a
contiguous group of layers; with ``virtual = V`` each of the ``P`` devices holds ``V`` chunks,
chunk ``c`` on device ``c % P`` (Megatron's interleaving). A tick lasts as long as the slowest
device's work in it.

**The schedules** differ only in the order each device takes its work and in how many
microbatches it may have in flight (forward done, backward not yet):

* ``gpipe``: all forwards, then all backwards; ``M`` in flight.
* ``1f1b``: a backward as soon as one is ready, a forward only while fewer than
  ``2(P - d) - 1`` are in flight on device ``d``. Asynchronous (MPMD) 1F1B holds ``P - d``;
  lockstep ticks make each hop cost a whole tick, so keeping every tick full of work needs about
  twice that. The bubble is GPipe's, ``(P - 1) / (M + P - 1)``; the memory no longer grows
  with ``M``.
* ``interleaved`` (``V >= 2``): 1F1B over ``P·V`` chunks, forwards in Megatron's order (groups of
  ``P`` microbatches, chunk by chunk), in flight ``2(P - d - 1) + (V - 1)P + 1``; the bubble
  falls to ``(P - 1) / (V·M + P - 1)``.

With ``1f1b`` and ``interleaved`` the last chunk's backward follows its forward in the same
tick, so the two are folded into one ``value_and_grad`` of the chunk and the loss
(:attr:`Schedule.folds_last`): only the chunk's input waits in a buffer, never the logits. GPipe
runs every backward after every forward, so there the last chunk's forward keeps its residuals
like any other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from jaxmp.config import SCHEDULES
from jaxmp.errors import ConfigError

KINDS = SCHEDULES
Action = tuple[int, int]  # (microbatch, chunk)


@dataclass(frozen=True)
class Program:
    """The executor's per-tick, per-device tables (``[ticks, devices]`` int arrays; -1: none).

    Buffers (each device's own, ``act_slots`` / ``res_slots`` / ``ct_slots`` wide):
    ``act``: chunk inputs received from the previous device (or kept for the last chunk),
    ``res``: what a forward keeps for its backward, ``ct``: cotangents from the next device.
    """

    f_mb: np.ndarray
    f_chunk: np.ndarray  # local chunk index v (the global chunk is v * P + device)
    f_act: np.ndarray  # act slot the forward reads (-1: chunk 0 reads the batch)
    f_res: np.ndarray  # res slot it fills
    b_mb: np.ndarray
    b_chunk: np.ndarray
    b_res: np.ndarray  # res slot the backward reads (-1: a folded last chunk)
    b_act: np.ndarray  # act slot a folded last chunk's backward reads (-1: other chunks)
    b_ct: np.ndarray  # ct slot it reads (-1: the last chunk, seeded by the loss)
    recv_act: np.ndarray  # act slot that takes what arrives from device d - 1 after the tick
    recv_ct: np.ndarray  # ct slot that takes what arrives from device d + 1 after the tick
    act_slots: int
    res_slots: int
    ct_slots: int

    @property
    def ticks(self) -> int:
        return int(self.f_mb.shape[0])


@dataclass(frozen=True)
class Schedule:
    """``kind`` over ``stages`` devices, ``microbatches`` per step, ``virtual`` chunks each."""

    kind: str
    stages: int
    microbatches: int
    virtual: int = 1
    _events: list = field(default_factory=list, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        p, m, v = self.stages, self.microbatches, self.virtual
        if self.kind not in KINDS:
            raise ConfigError(f"pipeline.schedule: must be one of {', '.join(KINDS)}, "
                              f"got {self.kind!r}")
        if p < 1 or m < 1 or v < 1:
            raise ConfigError(f"pipeline: stages, microbatches and virtual stages must be >= 1, "
                              f"got {p}, {m}, {v}")
        if self.kind == "interleaved" and v < 2:
            raise ConfigError(f"pipeline.virtual_stages: the interleaved schedule needs >= 2 "
                              f"chunks per device, got {v}")
        if self.kind != "interleaved" and v != 1:
            raise ConfigError(f"pipeline.virtual_stages: only the interleaved schedule uses "
                              f"virtual stages; {self.kind} needs 1, got {v}")
        if self.kind != "gpipe" and p > 1 and m < p:
            raise ConfigError(f"train.microbatches: {self.kind} needs at least as many "
                              f"microbatches as stages ({p}), got {m}")
        if self.kind == "interleaved" and m % p:
            raise ConfigError(f"train.microbatches: the interleaved schedule takes "
                              f"microbatches in groups of the stage count ({p}), got {m}")

    # -- closed forms (the planner's) -----------------------------------------------------------
    @property
    def folds_last(self) -> bool:
        """Whether the last chunk's forward runs inside its backward (not with GPipe)."""
        return self.kind != "gpipe"

    @property
    def chunks(self) -> int:
        return self.stages * self.virtual

    @property
    def n_ticks(self) -> int:
        """Ticks of one step (equal to the simulated table's length; tested)."""
        p, m, v = self.stages, self.microbatches, self.virtual
        if p == 1:
            return m
        if self.kind == "gpipe":
            return 2 * (m + p - 1) - 1
        return v * m + (v + 1) * p - 2

    def in_flight(self, device: int) -> int:
        """Most microbatch-chunks whose forward is done and backward is not, on ``device``."""
        p, m, v = self.stages, self.microbatches, self.virtual
        if self.kind == "gpipe" or p == 1:
            return m
        return min(v * m, 2 * (p - device - 1) + (v - 1) * p + 1)

    @property
    def bubble_fraction(self) -> float:
        """Idle share of a step when every chunk takes the same time: (P-1)/(V·M + P-1)."""
        p = self.stages
        return (p - 1) / (self.virtual * self.microbatches + p - 1)

    def step_units(self) -> int:
        """Step time in units of one chunk's forward+backward, chunks equal: V·M + P - 1."""
        return self.virtual * self.microbatches + self.stages - 1

    # -- the table ------------------------------------------------------------------------------
    def _orders(self, device: int) -> tuple[list[Action], list[Action]]:
        p, m, v = self.stages, self.microbatches, self.virtual
        if self.kind != "interleaved":
            work = [(i, device) for i in range(m)]
            return work, list(work)
        fwd, bwd = [], []
        for g in range(m // p):
            group = range(g * p, (g + 1) * p)
            for k in range(v):
                fwd += [(i, k * p + device) for i in group]
            for k in reversed(range(v)):
                bwd += [(i, k * p + device) for i in group]
        return fwd, bwd

    def _limit(self, device: int) -> int:
        if self.kind == "gpipe":
            return 1 << 30
        return 2 * (self.stages - device - 1) + (self.virtual - 1) * self.stages + 1

    @cached_property
    def events(self) -> list[list[tuple[Action | None, Action | None]]]:
        """``events[t][d] = (forward, backward)`` actions of device ``d`` at tick ``t``."""
        p, last = self.stages, self.chunks - 1
        orders = [self._orders(d) for d in range(p)]
        f_done: dict[Action, int] = {}
        b_done: dict[Action, int] = {}
        fi, bi = [0] * p, [0] * p
        table = []
        while any(bi[d] < len(orders[d][1]) for d in range(p)):
            t, row = len(table), []
            for d in range(p):
                fwd, bwd = orders[d]
                f = b = None
                if fi[d] < len(fwd) and fi[d] - bi[d] < self._limit(d):
                    mb, c = fwd[fi[d]]
                    if c == 0 or f_done.get((mb, c - 1), t) < t:
                        f, f_done[(mb, c)], fi[d] = (mb, c), t, fi[d] + 1
                if bi[d] < len(bwd) and (self.kind != "gpipe" or fi[d] == len(fwd)):
                    mb, c = bwd[bi[d]]
                    if f_done.get((mb, c), t + 1) <= t and (
                            c == last or b_done.get((mb, c + 1), t) < t):
                        b, b_done[(mb, c)], bi[d] = (mb, c), t, bi[d] + 1
                row.append((f, b))
            table.append(row)
            if len(table) > 4 * (self.n_ticks + 4):  # pragma: no cover - a schedule bug
                raise RuntimeError(f"schedule {self} does not terminate")
        return table

    def lockstep_time(self, forward_s: list[float], backward_s: list[float]) -> float:
        """One step's time: each tick lasts as long as its slowest device, whose work is the
        forward and backward it runs (per chunk ``c``: ``forward_s[c]``, ``backward_s[c]``; the
        last chunk's forward runs inside its backward)."""
        last = self.chunks - 1 if self.folds_last else -1
        total = 0.0
        for row in self.events:
            busy = [(forward_s[f[1]] if f and f[1] != last else 0.0)
                    + (backward_s[b[1]] + (forward_s[b[1]] if b[1] == last else 0.0) if b else 0.0)
                    for f, b in row]
            total += max(busy)
        return total

    def program(self) -> Program:
        """The tables the executor runs, with buffer slots assigned device by device."""
        p, last, ticks = self.stages, self.chunks - 1, len(self.events)
        folded = last if self.folds_last else -1  # the chunk whose forward runs in its backward
        shape = (ticks, p)
        cols = {k: np.full(shape, -1, np.int32) for k in (
            "f_mb", "f_chunk", "f_act", "f_res", "b_mb", "b_chunk", "b_res", "b_act", "b_ct",
            "recv_act", "recv_ct")}
        pools = {k: [_Pool() for _ in range(p)] for k in ("act", "res", "ct")}
        act_of: dict[Action, int] = {}
        ct_of: dict[Action, int] = {}
        res_of: dict[Action, int] = {}
        for t, row in enumerate(self.events):
            for d, (f, b) in enumerate(row):
                if f is not None and f[1] != folded:
                    cols["f_mb"][t, d], cols["f_chunk"][t, d] = f[0], f[1] // p
                    if f[1] > 0:
                        cols["f_act"][t, d] = act_of.pop(f)
                        pools["act"][d].free(cols["f_act"][t, d])
                    cols["f_res"][t, d] = res_of[f] = pools["res"][d].take()
                    if f[1] + 1 <= last:  # its output goes to the next chunk's device
                        nxt, dev = (f[0], f[1] + 1), (d + 1) % p
                        cols["recv_act"][t, dev] = act_of[nxt] = pools["act"][dev].take()
                if b is not None:
                    cols["b_mb"][t, d], cols["b_chunk"][t, d] = b[0], b[1] // p
                    if b[1] == folded:
                        cols["b_act"][t, d] = act_of.pop(b)
                        pools["act"][d].free(cols["b_act"][t, d])
                    else:
                        cols["b_res"][t, d] = res_of.pop(b)
                        pools["res"][d].free(cols["b_res"][t, d])
                    if b[1] != last:
                        cols["b_ct"][t, d] = ct_of.pop(b)
                        pools["ct"][d].free(cols["b_ct"][t, d])
                    if b[1] > 0:  # its input's cotangent goes to the previous chunk's device
                        prv, dev = (b[0], b[1] - 1), (d - 1) % p
                        cols["recv_ct"][t, dev] = ct_of[prv] = pools["ct"][dev].take()
        # A slot freed at tick t is only reused by an arrival after that tick's work: arrivals
        # are written at the end of the tick, reads happen during it, so the reuse is safe.
        return Program(**cols, act_slots=max(1, max(x.peak for x in pools["act"])),
                       res_slots=max(1, max(x.peak for x in pools["res"])),
                       ct_slots=max(1, max(x.peak for x in pools["ct"])))


class _Pool:
    """Buffer slots of one device: the lowest free index is taken, the peak is the size."""

    def __init__(self) -> None:
        self.free_slots: list[int] = []
        self.peak = 0

    def take(self) -> int:
        if self.free_slots:
            return self.free_slots.pop(self.free_slots.index(min(self.free_slots)))
        self.peak += 1
        return self.peak - 1

    def free(self, slot: int) -> None:
        self.free_slots.append(int(slot))
