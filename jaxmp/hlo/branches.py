"""Collective bytes of a program whose conditionals run one branch: the static upper bound.

:func:`jaxmp.hlo.collective_stats` counts every collective at its computation's multiplier, so
a ``conditional``'s branches are all charged, as if each ran (the HLO text holds them all, on
any backend). One runs per execution; :func:`one_branch_bytes` charges each conditional its
most expensive branch instead — what any one device can send at most. The pipeline executor's
tick loop is the case that matters: a tick runs a forward or not, a stashed or a folded
backward, the first chunk's embedding or not. That static bound charges every tick with a
forward and a backward, including a device's idle (bubble) ticks, and every busy tick with the
first and the last chunk's extra work; given each device's ticks from the schedule
(:class:`TickDevice`), each conditional is charged on the ticks that run it — the count a
device executes (what devices *execute* is also measured from a run:
:mod:`jaxmp.hlo.executed`).

``memory_analysis()`` needs no such correction: buffer assignment shares the branches' buffers
(a conditional's temporaries are its largest branch's; checked on the CPU backend).
"""
from __future__ import annotations

import re
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from jaxmp.hlo.collectives import CollectiveStats
from jaxmp.hlo.module import HloModule


def _hlo_text(obj: Any) -> str:
    return obj if isinstance(obj, str) else obj.as_text()


def _size(bytes_by_kind: Counter) -> float:
    return sum(bytes_by_kind.values())


_OP_NAME = re.compile(r'op_name="([^"]*)"')


def _scope_of(ins: Any, scopes: Collection[str]) -> str | None:
    """The one of ``scopes`` that names conditional ``ins`` itself: its ``op_name`` ends in
    ``scope/cond`` (or ``transpose(jvp(scope))/cond``), not a scope around it."""
    m = _OP_NAME.search(ins.raw_attrs)
    return next((s for s in scopes if m and re.search(re.escape(s) + r"\)*/cond$", m.group(1))),
                None)


@dataclass(frozen=True)
class TickDevice:
    """One device of a pipelined program, as the static count charges it.

    ``busy``: by the name scope of a tick loop's conditional (the executor's forward and
    backward: :data:`jaxmp.pipeline.ticks.FORWARD_TICK`), the share of the loop's ticks on
    which it runs its work; the rest it runs its smallest (idle) branch. ``held``: the chunk-only scopes whose
    chunk this device holds, one of its ``chunks`` chunks each (the first chunk runs the
    embedding, the last the head and loss: :data:`jaxmp.pipeline.chunk.FIRST_CHUNK`)."""

    busy: Mapping[str, float]
    held: frozenset[str] = frozenset()
    chunks: int = 1


def one_branch_bytes(stats: CollectiveStats, compiled_or_text: Any,
                     devices: Sequence[TickDevice] = (),
                     chunk_scopes: frozenset[str] = frozenset()) -> dict[str, float]:
    """``stats``' bytes by kind with each conditional charged its largest branch (by total
    bytes), per execution of the program. ``stats`` must come from the same program.

    ``devices`` (a pipelined program: each device's ticks, :class:`TickDevice`): a tick loop's
    conditional (named by a scope in ``busy``; also in the iterations XLA peels off the loop)
    runs its largest branch on the device's busy share of ticks, its smallest on the rest. Inside a busy tick, a conditional named by one of
    ``chunk_scopes`` runs its largest branch on ``1/V`` of the ticks of a device that holds
    that scope's chunk and never on another (nested in its own scope's branch: always or
    never). The busiest device is reported: the count a device executes, not the static bound
    (any other conditional, and one in a loop inside a tick — padding rows — counts its
    largest branch)."""
    mod = HloModule(_hlo_text(compiled_or_text))
    own: dict[str, Counter] = {}
    for op in stats.ops:  # per execution of the op's computation
        own.setdefault(op.computation, Counter())[op.kind] += op.sent_bytes

    def count(device: TickDevice | None) -> Counter:
        memo: dict[tuple, Counter] = {}

        def share(ins: Any, in_tick: bool, known: frozenset) -> tuple[float | None, str | None]:
            """(the share of executions that run the largest branch, the chunk scope)."""
            if device is None:
                return None, None
            if (scope := _scope_of(ins, device.busy)) is not None:
                return device.busy[scope], None
            scope = _scope_of(ins, chunk_scopes) if in_tick else None
            if scope is None:
                return None, None
            if (scope, True) in known or (scope, False) in known:
                return (1.0 if (scope, True) in known else 0.0), scope
            return (1.0 / device.chunks if scope in device.held else 0.0), scope

        def total(comp: str, in_tick: bool, known: frozenset, depth: int = 0) -> Counter:
            key = (comp, in_tick, known)
            if key in memo:
                return memo[key]
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
                    part, scope = share(ins, in_tick, known)
                    inner = in_tick or (part is not None and scope is None)
                    def branches(taken: bool) -> list[Counter]:
                        told = known | {(scope, taken)} if scope else known
                        return [total(c, inner, told, depth + 1) for c in callees]

                    most = max(branches(True), key=_size)
                    least = min(branches(False), key=_size)
                    part = 1.0 if part is None else part
                    for kind in set(most) | set(least):
                        out[kind] += part * most[kind] + (1.0 - part) * least[kind]
                    continue
                trips = mod.trip_count(comp, ins) if ins.opcode == "while" else None
                for attr, callee in ins.callees:
                    if callee not in callees:
                        continue
                    times = (trips or 1) + (attr == "condition" and trips is not None)
                    deeper = in_tick and ins.opcode != "while"
                    for kind, b in total(callee, deeper, known, depth + 1).items():
                        out[kind] += times * b
            memo[key] = out
            return out

        return total(mod.entry, False, frozenset())

    if mod.entry is None:
        return dict(stats.bytes_by_kind)
    found = max((count(d) for d in devices or (None,)), key=lambda c: sum(c.values()))
    return {k: float(found.get(k, 0.0)) for k in stats.bytes_by_kind}
