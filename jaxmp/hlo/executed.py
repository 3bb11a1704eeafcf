"""Collective bytes as a run executed them: counts per device from a profiler trace.

A static count of a program's collectives (:func:`jaxmp.hlo.collective_stats`) cannot know
which branch of a ``conditional`` runs, nor how often: a pipeline's tick runs a forward only
when its device has one, so devices send different bytes and none sends what the text holds
(:mod:`jaxmp.hlo.branches`). The CPU backend's profiler records every instruction it executes,
with the device and the HLO instruction's name; :func:`executed_bytes` multiplies each
collective's bytes per execution (from the HLO, as the static count sizes them) by how often
each device ran it, and reports the busiest device. Stdlib only: the trace is the
``*.trace.json.gz`` that ``jax.profiler.stop_trace`` writes.
"""
from __future__ import annotations

import gzip
import json
from collections import Counter
from collections.abc import Mapping
from pathlib import Path

from jaxmp.hlo.collectives import CollectiveStats


def trace_counts(trace_dir: str | Path, module: str | None = None) -> dict[int, Counter]:
    """``{device: {hlo instruction: executions}}`` from the newest trace under ``trace_dir``
    (only ``module``'s instructions when given, e.g. ``"jit_step"``). Empty when the backend
    wrote no per-instruction events (accelerators trace differently)."""
    files = sorted(Path(trace_dir).rglob("*.trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not files:
        return {}
    with gzip.open(files[-1], "rt", encoding="utf-8") as f:
        events = json.load(f).get("traceEvents", [])
    out: dict[int, Counter] = {}
    for e in events:
        args = e.get("args") or {}
        op, device = args.get("hlo_op"), args.get("device_ordinal")
        if e.get("ph") != "X" or op is None or device is None:
            continue
        if module is not None and args.get("hlo_module") != module:
            continue
        out.setdefault(int(device), Counter())[op] += 1
    return out


def executed_bytes(stats: CollectiveStats, counts: Mapping[int, Mapping[str, int]]
                   ) -> dict[str, float] | None:
    """Bytes by collective kind that the busiest device sent, its instructions counted as
    executed (``counts`` from :func:`trace_counts`); None when ``counts`` holds none of the
    program's collectives while the program has some (nothing was recorded)."""
    per_device: dict[int, Counter] = {}
    seen = False
    for device, ran in counts.items():
        sent = per_device.setdefault(device, Counter())
        for op in stats.ops:  # an all-reduce folded into a reduce-scatter has two parts
            times = ran.get(op.name, 0)
            seen = seen or times > 0
            sent[op.kind] += op.sent_bytes * times
    if not seen:
        return None if stats.ops else {k: 0.0 for k in stats.bytes_by_kind}
    busiest = max(per_device.values(), key=lambda c: sum(c.values()))
    return {k: float(busiest.get(k, 0.0)) for k in stats.bytes_by_kind}


def module_name(hlo_text: str) -> str | None:
    """The ``HloModule`` name of a program's text (what trace events call it)."""
    first = hlo_text.lstrip().split("\n", 1)[0]
    if not first.startswith("HloModule "):
        return None
    return first.split()[1].rstrip(",")
