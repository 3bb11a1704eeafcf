"""Collective bytes of a program whose conditionals run one branch: the static upper bound.

:func:`jaxmp.hlo.collective_stats` counts every collective at its computation's multiplier, so
a ``conditional``'s branches are all charged, as if each ran (the HLO text holds them all, on
any backend). One runs per execution; :func:`one_branch_bytes` charges each conditional its
most expensive branch instead — what any one device can send at most. The pipeline executor's
tick loop is the case that matters: a tick runs a forward or not, a stashed or a folded
backward. That static bound still charges every tick with a forward and a backward, including
a device's idle (bubble) ticks, and every device with the work of the busiest; what devices
*execute* is measured from a run (:mod:`jaxmp.hlo.executed`).

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


def one_branch_bytes(stats: CollectiveStats, compiled_or_text: Any) -> dict[str, float]:
    """``stats``' bytes by kind with each conditional charged its largest branch (by total
    bytes), per execution of the program. ``stats`` must come from the same program."""
    mod = HloModule(_hlo_text(compiled_or_text))
    own: dict[str, Counter] = {}
    for op in stats.ops:  # per execution of the op's computation
        own.setdefault(op.computation, Counter())[op.kind] += op.sent_bytes
    memo: dict[str, Counter] = {}

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
                out.update(max((total(c, depth + 1) for c in callees),
                               key=lambda k: sum(k.values())))
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
