"""Bytes each device sends per step, read from the optimized HLO text of a compiled XLA program.

Why: the planner predicts communication, and every prediction must be checkable.
`compiled.cost_analysis()` reports no collective bytes and undercounts loop bodies, so we parse
`compiled.as_text()` ourselves: find every collective, size its buffers, apply the ring formula
for its replica-group size N, and multiply by the trip counts of the while loops around it.

Ring formulas (S = bytes of one device's buffer):
  all-reduce 2(N-1)/N*S · all-gather (N-1)/N*S_out · reduce-scatter (N-1)/N*S_in ·
  all-to-all (N-1)/N*S · collective-permute S.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from jaxmp.hlo.module import HloModule, Instr, shape_bytes

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_OPCODES = {k: k for k in KINDS} | {k + "-start": k for k in KINDS}

@dataclass
class CollectiveOp:
    """One collective instruction; `sent_bytes` is per execution, `multiplier` executions per step."""
    kind: str
    name: str
    shape: str
    bytes: int  # the S of the ring formula
    group_size: int
    multiplier: int
    sent_bytes: float
    computation: str
    lowered_as: str = ""  # e.g. "all-reduce+dynamic-slice" for a reduce-scatter in disguise

    @property
    def total_sent_bytes(self) -> float:
        return self.sent_bytes * self.multiplier


@dataclass
class CollectiveStats:
    """Per-device bytes sent per step (all loop iterations included), by collective kind."""
    bytes_by_kind: dict[str, float] = field(default_factory=lambda: {k: 0.0 for k in KINDS})
    count_by_kind: dict[str, int] = field(default_factory=lambda: {k: 0 for k in KINDS})
    ops: list[CollectiveOp] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    raw_total_bytes: float = 0.0  # as compiled, before folding all-reduce+slice (see below)

    @property
    def total_bytes(self) -> float:
        return sum(self.bytes_by_kind.values())

    def summary(self) -> str:
        rows = [f"{'collective':<20}{'count':>8}{'bytes/device':>16}"]
        rows += [f"{k:<20}{self.count_by_kind[k]:>8}{self.bytes_by_kind[k]:>16,.0f}"
                 for k in KINDS if self.count_by_kind[k]]
        rows.append(f"{'total':<20}{sum(self.count_by_kind.values()):>8}{self.total_bytes:>16,.0f}")
        return "\n".join(rows + [f"warning: {w}" for w in self.warnings])


def _group_size(attrs: str, total: int | None) -> int | None:
    """Participants per replica group; `total` stands in for the empty `{}` (all devices)."""
    m = re.search(r"replica_groups=\[([\d,]+)\]<=", attrs)  # iota: [groups,size]<=[...]
    if m:
        return int(m.group(1).split(",")[-1])
    m = re.search(r"replica_groups=mesh\[([^\]]*)\][^{]*\{([^}]*)\}", attrs)  # mesh-axes form
    if m:
        sizes = {n: int(s) for n, s in re.findall(r"'?([\w.\-]+)'?\s*=\s*(\d+)", m.group(1))}
        size = 1
        for ref in filter(None, (r.strip() for r in m.group(2).split(","))):
            r = re.fullmatch(r"'?([\w.\-]+)'?(?::\((\d+)\)(\d+))?", ref)
            size *= int(r.group(3)) if r and r.group(3) else sizes.get(r.group(1) if r else ref, 1)
        return size
    m = re.search(r"replica_groups=\{\s*(\{[^}]*\})?", attrs)
    if m and m.group(1):
        return len(re.findall(r"\d+", m.group(1)))
    return total  # `replica_groups={}` or absent: one group of every device


def tuple_parts(shape: str) -> list[str]:
    """The top-level elements of a tuple shape (``"(a, (b, c))"`` → ``["a", "(b, c)"]``);
    an array shape is its own single part."""
    shape = re.sub(r"/\*.*?\*/", "", shape).strip()
    if not shape.startswith("("):
        return [shape]
    parts, depth, start = [], 0, 1
    for i, ch in enumerate(shape):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if (ch == "," and depth == 1) or (depth == 0 and ch == ")"):
            parts.append(shape[start:i].strip())
            start = i + 1
        if depth == 0:
            break
    return [p for p in parts if p]


def _result_shape(ins: Instr) -> str:
    """The result part of an async start's shape: ``all-to-all-start`` (and jax 0.12's
    ``all-reduce-start``) returns ``((operands), result)``, earlier all-reduces the result."""
    parts = tuple_parts(ins.shape)
    if ins.opcode in ("all-reduce-start", "all-to-all-start") and len(parts) == 2 \
            and parts[0].startswith("("):
        return parts[1]
    return ins.shape


def _sized(kind: str, ins: Instr, shapes: dict[str, str], n: int, warn: list[str]) -> int:
    """The S of the ring formula, from the result shape or (where needed) the operand shapes."""
    out = shape_bytes(_result_shape(ins))
    known = [s or shapes.get(name) for name, s in ins.operands]
    s_in = sum(shape_bytes(s) for s in known) if known and None not in known else None
    start = ins.opcode.endswith("-start")
    if kind == "all-gather" and start:
        return out - s_in if s_in is not None else out
    if kind == "reduce-scatter":
        return s_in if s_in is not None else out * n
    if kind == "collective-permute" and start:  # combined permutes send every operand
        if s_in is not None:
            return s_in
        warn.append(f"{ins.name}: operand shape unknown, sized from its result tuple")
    return out


def _ring(kind: str, s: int, n: int) -> float:
    if kind == "collective-permute":
        return float(s)
    if n <= 1:
        return 0.0
    return (2.0 if kind == "all-reduce" else 1.0) * (n - 1) / n * s


def _multipliers(mod: HloModule, warn: list[str]) -> tuple[dict[str, int], set[str]]:
    """Executions per step of each computation reachable from ENTRY (trip counts folded in), and
    the computations that run only under a conditional branch (counted as if the branch ran)."""
    callers: dict[str, list[tuple[str, int, bool]]] = {}
    seen, todo = {mod.entry}, [mod.entry]
    while todo:
        comp = todo.pop()
        for ins in mod.comps.get(comp, {}).values():
            if ins.opcode.endswith(("-done", "-update")):
                continue  # the -start half already carries the async computation
            trips = mod.trip_count(comp, ins) if ins.opcode == "while" else None
            if ins.opcode == "while" and trips is None:
                warn.append(f"{comp}/{ins.name}: trip count unknown, loop body counted once")
            for attr, callee in ins.callees:
                if attr == "to_apply" and ins.opcode != "call" or callee not in mod.comps:
                    continue  # reduction lambdas hold no collectives
                loop = trips is not None and attr in ("body", "condition")
                branch = ins.opcode == "conditional"
                callers.setdefault(callee, []).append(
                    (comp, trips + (attr == "condition") if loop else 1, branch))
                if callee not in seen:
                    seen.add(callee)
                    todo.append(callee)
    memo: dict[str, int] = {mod.entry: 1}

    def mult(c: str) -> int:
        if c not in memo:
            memo[c] = sum(mult(p) * f for p, f, _ in callers.get(c, []))
        return memo[c]

    branchy: set[str] = set()
    changed = True
    while changed:  # a fixed point: under a branch if any call edge is a branch or from one
        grown = {c for c, edges in callers.items() if any(b or p in branchy for p, _, b in edges)}
        changed, branchy = grown != branchy, grown
    return {c: mult(c) for c in seen}, branchy


_PASS_THROUGH = {"bitcast", "copy", "reshape", "transpose", "get-tuple-element", "convert"}


def _users(instrs: dict[str, Instr]) -> dict[str, list[Instr]]:
    users: dict[str, list[Instr]] = {}
    for ins in instrs.values():
        for name, _ in ins.operands:
            users.setdefault(name, []).append(ins)
    return users


def _only_sliced(mod: HloModule, comp: str, value: str, size: int, n: int, depth: int = 0) -> bool:
    """True if every use of ``value`` dynamic-slices it down to at most 1/n of ``size`` bytes.

    Follows bitcasts/copies/transposes and enters fusions (the slice is often fused with its
    consumer). This is the pattern GPU/TPU pipelines rewrite into a reduce-scatter.
    """
    instrs = mod.comps[comp]
    users = _users(instrs).get(value, [])
    if not users or depth > 8:
        return False
    for u in users:
        if u.opcode == "dynamic-slice" and u.operands and u.operands[0][0] == value:
            if shape_bytes(u.shape) * n > size:
                return False
        elif u.opcode in _PASS_THROUGH:
            if not _only_sliced(mod, comp, u.name, size, n, depth + 1):
                return False
        elif u.opcode == "fusion" and u.callees:
            fused = u.callees[0][1]
            params = {int(m.group(1)): i.name for i in mod.comps.get(fused, {}).values()
                      if i.opcode == "parameter" and (m := re.match(r"(\d+)", i.args.strip()))}
            idx = [k for k, (name, _) in enumerate(u.operands) if name == value]
            if not idx or not all(k in params and _only_sliced(mod, fused, params[k], size, n,
                                                                  depth + 1) for k in idx):
                return False
        else:
            return False
    return True


def _scattered_bytes(mod: HloModule, comp: str, ins: Instr, n: int) -> int:
    """Bytes of an all-reduce's result that are only ever sliced to this device's 1/n share."""
    if n <= 1:
        return 0
    if not ins.shape.startswith("("):
        return shape_bytes(ins.shape) if _only_sliced(mod, comp, ins.name, shape_bytes(ins.shape), n) else 0
    total = 0
    for u in _users(mod.comps[comp]).get(ins.name, []):
        if u.opcode == "get-tuple-element":
            size = shape_bytes(u.shape)
            if _only_sliced(mod, comp, u.name, size, n):
                total += size
    return total


def _hlo_text(obj: Any) -> str:
    if isinstance(obj, str):
        return obj
    if hasattr(obj, "compile"):  # jax.stages.Lowered: its as_text() is StableHLO, not optimized HLO
        obj = obj.compile()
    return obj.as_text()


def collective_stats(compiled_or_text: Any, num_devices: int | None = None,
                     fold_reduce_scatter: bool = True) -> CollectiveStats:
    """Bytes one device sends per execution of a Compiled / Lowered / HLO text, by collective kind.

    `num_devices` sizes `replica_groups={}` (all devices); by default it is num_partitions x
    replica_count from the module header. A collective-permute counts S for every device, the
    most any one device sends.

    With `fold_reduce_scatter`, the part of an all-reduce whose result is only ever
    dynamic-sliced to this device's 1/N share is counted as the reduce-scatter it is: the SPMD
    partitioner emits all-reduce + dynamic-slice and relies on a later pass (GPU/TPU:
    ReduceScatterCreator) to fuse them; the CPU backend has no such pass. `raw_total_bytes`
    keeps what the program sends as compiled.
    """
    mod = HloModule(_hlo_text(compiled_or_text))
    stats = CollectiveStats()
    if mod.entry is None:
        stats.warnings.append("no ENTRY computation found")
        return stats
    total = num_devices if num_devices is not None else mod.num_devices
    mults, branchy = _multipliers(mod, stats.warnings)
    for comp, times in mults.items():
        instrs = mod.comps[comp]
        shapes = {name: ins.shape for name, ins in instrs.items()}
        for ins in instrs.values():
            kind = _OPCODES.get(ins.opcode)
            if kind is None:
                continue
            if kind == "collective-permute":
                pairs = re.search(r"source_target_pairs=\{(.*?)\}\}", ins.attrs)
                n = len(set(re.findall(r"\d+", pairs.group(1)))) if pairs else 0
            else:
                n = _group_size(ins.attrs, total)
                if n is None:
                    stats.warnings.append(f"{ins.name}: replica_groups={{}} but device count unknown")
                    n = 1
            s = _sized(kind, ins, shapes, n, stats.warnings)
            if comp in branchy:
                stats.warnings.append(f"{ins.name}: under a conditional, counted as if it ran")
            stats.raw_total_bytes += _ring(kind, s, n) * times
            parts = [(kind, s, "")]
            if kind == "all-reduce" and fold_reduce_scatter:
                scattered = min(_scattered_bytes(mod, comp, ins, n), s)
                if scattered:
                    parts = [("reduce-scatter", scattered, "all-reduce+dynamic-slice")]
                    parts += [(kind, s - scattered, "")] if s > scattered else []
            for k, size, lowered in parts:
                op = CollectiveOp(k, ins.name, ins.shape, size, n, times, _ring(k, size, n), comp,
                                  lowered)
                stats.ops.append(op)
                stats.count_by_kind[k] += times
                stats.bytes_by_kind[k] += op.total_sent_bytes
    return stats
