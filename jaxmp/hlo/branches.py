"""Collective bytes of a program whose conditionals run one branch: the static upper bound.

:func:`jaxmp.hlo.collective_stats` counts every collective at its computation's multiplier, so
a ``conditional``'s branches are all charged, as if each ran (the HLO text holds them all, on
any backend). One runs per execution; :func:`one_branch_bytes` charges each conditional its
most expensive branch instead — what any one device can send at most. The pipeline executor's
tick loop is the case that matters: a tick runs a forward or not, a stashed or a folded
backward. That static bound charges every tick with a forward and a backward, including a
device's idle (bubble) ticks; given the schedule's busy share of ticks (``tick_busy``), the
ticks' conditionals are charged on that share only — the true count of a device that runs
every tick's largest branch when busy (what devices *execute* is also measured from a run:
:mod:`jaxmp.hlo.executed`).

``memory_analysis()`` needs no such correction: buffer assignment shares the branches' buffers
(a conditional's temporaries are its largest branch's; checked on the CPU backend).
"""
from __future__ import annotations

from collections import Counter
from typing import Any

from jaxmp.hlo.collectives import CollectiveStats
from jaxmp.hlo.module import HloModule


def _hlo_text(obj: Any) -> str:
    return obj if isinstance(obj, str) else obj.as_text()


def one_branch_bytes(stats: CollectiveStats, compiled_or_text: Any,
                     tick_busy: float | None = None) -> dict[str, float]:
    """``stats``' bytes by kind with each conditional charged its largest branch (by total
    bytes), per execution of the program. ``stats`` must come from the same program.

    ``tick_busy`` (a pipelined program): the fraction of a tick loop's iterations on which a
    tick's conditionals run their work — ``M·V`` forwards and as many backwards per device in
    ``T`` ticks (:func:`tick_busy_fraction`). A conditional beside the ticks' shift (in a
    computation that holds a collective-permute: the tick loop's body, or the iterations XLA
    peels off it) is charged its largest branch that often, not on every tick: the count a
    device executes, not the static bound."""
    mod = HloModule(_hlo_text(compiled_or_text))
    own: dict[str, Counter] = {}
    for op in stats.ops:  # per execution of the op's computation
        own.setdefault(op.computation, Counter())[op.kind] += op.sent_bytes
    memo: dict[str, Counter] = {}
    ticking = {comp for comp, instrs in mod.comps.items() if any(
        ins.opcode in ("collective-permute", "collective-permute-start")
        for ins in instrs.values())}

    def total(comp: str, depth: int = 0) -> Counter:
        if comp in memo:
            return memo[comp]
        out = Counter(own.get(comp, Counter()))
        if depth > 64:  # pragma: no cover - a cyclic call graph is not HLO
            return out
        for ins in mod.comps.get(comp, {}).values():
            if ins.opcode.endswith(("-done", "-update")):
                continue  # the -start half already carries the async computation
            callees = [c for attr, c in ins.callees if c in mod.comps
                       and (attr != "to_apply" or ins.opcode == "call")]
            if not callees:
                continue
            if ins.opcode == "conditional":
                most = max((total(c, depth + 1) for c in callees),
                           key=lambda k: sum(k.values()))
                share = tick_busy if tick_busy is not None and comp in ticking else 1.0
                for kind, b in most.items():
                    out[kind] += share * b
                continue
            trips = mod.trip_count(comp, ins) if ins.opcode == "while" else None
            for attr, callee in ins.callees:
                if callee not in callees:
                    continue
                times = (trips or 1) + (attr == "condition" and trips is not None)
                for kind, b in total(callee, depth + 1).items():
                    out[kind] += times * b
        memo[comp] = out
        return out

    if mod.entry is None:
        return dict(stats.bytes_by_kind)
    found = total(mod.entry)
    return {k: float(found.get(k, 0.0)) for k in stats.bytes_by_kind}


def tick_busy_fraction(microbatches: int, virtual: int, ticks: int) -> float:
    """The share of a pipeline's ticks on which a device runs a forward (or a backward):
    ``M·V`` of ``T`` (every device runs each of its chunks once per microbatch each way)."""
    return min(1.0, microbatches * virtual / ticks) if ticks else 1.0
