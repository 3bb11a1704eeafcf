"""Which collectives of a scheduled GPU program overlap compute, and which leave it waiting.

XLA's GPU backend issues most collectives asynchronously, as a ``*-start`` / ``*-done`` pair,
and its latency-hiding scheduler moves independent work between the two. The optimized HLO of
a compiled program (``is_scheduled=true``) lists each computation's instructions in the order
they run. A pair is *overlapped* when a matmul (a dot or convolution, inside a fusion or a
library call such as cuBLAS / cuDNN, or in a loop) is scheduled between its start and its
done, and *exposed* otherwise: the device waits for the transfer. Small elementwise fusions
between the two (``compute_between`` counts all compute) do not hide a weight gather, so they
do not count as overlap; the report shows them apart. A collective without the pair (small
ones may stay synchronous) is *sync*.

A start whose done is not after it in the same computation was pipelined across a loop
iteration (its done runs in the next one): overlapped by construction.

For fsdp the question that matters is the weight all-gathers inside the layer loop (a
``while`` body): exposed there, every layer waits for its weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from jaxmp.hlo.collectives import KINDS, _hlo_text, collective_stats
from jaxmp.hlo.module import HloModule, Instr

# Instructions that are not work on the device: bookkeeping, aliases and other halves of
# async pairs. ``copy`` is left out too: a loop counter's copy would otherwise "overlap".
_NOT_COMPUTE = frozenset("""
parameter constant get-tuple-element tuple bitcast copy after-all add-dependency opt-barrier
partition-id replica-id send recv send-done recv-done copy-start copy-done
""".split())


def _is_compute(ins: Instr) -> bool:
    op = ins.opcode
    if op in _NOT_COMPUTE or op.endswith("-done"):
        return False
    base = op[:-len("-start")] if op.endswith("-start") else op
    return base not in KINDS and op not in ("async-start", "async-update")


_MATMUL_OPS = ("dot", "convolution")
_LIBRARY = ("gemm", "cublas", "cudnn", "triton")  # custom-call targets / fusion kinds


def _has_matmul(mod: HloModule, ins: Instr, memo: dict[str, bool]) -> bool:
    """Whether ``ins`` runs a matmul: itself, a library kernel, or inside what it calls."""
    if ins.opcode in _MATMUL_OPS:
        return True
    if ins.opcode == "custom-call":
        return any(k in ins.raw_attrs.lower() for k in _LIBRARY)
    for _, callee in ins.callees:
        if callee not in memo:
            memo[callee] = False  # cycles cannot occur in HLO; this only guards recursion
            memo[callee] = any(_has_matmul(mod, x, memo)
                               for x in mod.comps.get(callee, {}).values())
        if memo[callee]:
            return True
    return False


@dataclass
class ScheduledCollective:
    """One collective (its ``*-start`` if async) and what the schedule put before its done."""

    kind: str
    name: str
    computation: str
    in_loop: bool  # inside a while body (e.g. the scanned layer stack)
    compute_between: int  # compute instructions scheduled between start and done
    matmuls_between: int  # of those, the ones that run a matmul (see the module docstring)
    pipelined: bool = False  # its done runs in the next loop iteration
    synchronous: bool = False  # no start / done pair: the device waits for it

    @property
    def overlapped(self) -> bool:
        return not self.synchronous and (self.pipelined or self.matmuls_between > 0)


@dataclass
class OverlapStats:
    """Per collective kind: bytes per device per step, and async pairs overlapped / exposed."""

    bytes_by_kind: dict[str, float] = field(default_factory=dict)
    collectives: list[ScheduledCollective] = field(default_factory=list)

    def by_kind(self) -> dict[str, dict[str, float]]:
        """``{kind: {"bytes", "async", "overlapped", "exposed", "exposed_beside_compute",
        "sync"}}`` for the kinds present; counts are instructions, bytes per step."""
        out = {}
        for k in KINDS:
            mine = [a for a in self.collectives if a.kind == k and not a.synchronous]
            exposed = [a for a in mine if not a.overlapped]
            row = {"bytes": float(self.bytes_by_kind.get(k, 0.0)), "async": len(mine),
                   "overlapped": len(mine) - len(exposed), "exposed": len(exposed),
                   "exposed_beside_compute": sum(a.compute_between > 0 for a in exposed),
                   "sync": sum(a.kind == k and a.synchronous for a in self.collectives)}
            if row["bytes"] or row["async"] or row["sync"]:
                out[k] = row
        return out

    @property
    def loop_all_gathers(self) -> list[ScheduledCollective]:
        """The all-gathers inside a loop body (async or not): fsdp's per-layer weight gathers."""
        return [a for a in self.collectives if a.kind == "all-gather" and a.in_loop]

    @property
    def exposed_loop_all_gathers(self) -> int:
        return sum(not a.overlapped for a in self.loop_all_gathers)

    def to_json(self) -> dict[str, Any]:
        return {"by_kind": self.by_kind(),
                "loop_all_gathers": len(self.loop_all_gathers),
                "loop_all_gathers_exposed": self.exposed_loop_all_gathers}

    def summary(self) -> str:
        rows = [f"{'collective':<20}{'bytes/device':>16}{'async':>7}{'overlap':>9}"
                f"{'exposed':>9}{'sync':>6}"]
        rows += [f"{k:<20}{r['bytes']:>16,.0f}{r['async']:>7}{r['overlapped']:>9}"
                 f"{r['exposed']:>9}{r['sync']:>6}" for k, r in self.by_kind().items()]
        if self.loop_all_gathers:
            rows.append(f"all-gathers in a loop body: {len(self.loop_all_gathers)}, exposed "
                        f"{self.exposed_loop_all_gathers}")
        return "\n".join(rows)


def _loop_bodies(mod: HloModule) -> set[str]:
    """Computations that run inside a ``while`` body (directly or through calls)."""
    inside: set[str] = set()
    todo = [callee for comp in mod.comps.values() for ins in comp.values()
            if ins.opcode == "while" for attr, callee in ins.callees if attr == "body"]
    while todo:
        c = todo.pop()
        if c in inside or c not in mod.comps:
            continue
        inside.add(c)
        todo += [callee for ins in mod.comps[c].values() for _, callee in ins.callees]
    return inside


def collective_overlap(compiled_or_text: Any, num_devices: int | None = None) -> OverlapStats:
    """Overlap of every async collective of a compiled (scheduled) program, with the bytes of
    :func:`jaxmp.hlo.collective_stats` per kind (GPU programs need no reduce-scatter folding:
    the backend emits real reduce-scatters)."""
    text = _hlo_text(compiled_or_text)
    mod = HloModule(text)
    stats = OverlapStats(bytes_by_kind=dict(collective_stats(text, num_devices).bytes_by_kind))
    loops = _loop_bodies(mod)
    memo: dict[str, bool] = {}
    for comp, instrs in mod.comps.items():
        order = list(instrs.values())
        for i, ins in enumerate(order):
            op = ins.opcode
            if op in KINDS:
                stats.collectives.append(ScheduledCollective(op, ins.name, comp, comp in loops,
                                                             0, 0, synchronous=True))
                continue
            if not (op.endswith("-start") and op[:-len("-start")] in KINDS):
                continue
            done = next((j for j in range(i + 1, len(order))
                         if order[j].opcode.endswith("-done") and order[j].operands
                         and order[j].operands[0][0] == ins.name), None)
            between = [] if done is None else [x for x in order[i + 1:done] if _is_compute(x)]
            matmuls = sum(_has_matmul(mod, x, memo) for x in between)
            stats.collectives.append(ScheduledCollective(op[:-len("-start")], ins.name, comp,
                                                         comp in loops, len(between), matmuls,
                                                         done is None))
    return stats
