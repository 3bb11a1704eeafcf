"""The most bytes a compiled module holds live at once, and which buffers, from XLA's dump.

``memory_analysis().temp_size_in_bytes`` is the heap XLA packs its temporaries into; the
planner predicts what is live (docs/planner.md §4). The two differ by how well the heap
packs (5 % on gpt-1b's shape at 2 layers, docs/planner.md §7 "Stop 32").
XLA's dump of a compiled module as a proto (``--xla_dump_to=DIR --xla_dump_hlo_as_proto``,
or ``compile(compiler_options=...)``) carries its buffer assignment with the heap
simulator's trace: every buffer's allocation and release in schedule order. Replaying it
gives the live set at the peak, buffer by buffer, named by the instruction that allocates
it. The proto is read field by field (protobuf's wire format): jaxlib ships no Python
bindings for XLA's protos.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

# xla/service/hlo.proto field numbers
_BUFFER_ASSIGNMENT = 3  # HloProto.buffer_assignment
_LOGICAL_BUFFERS, _TRACES = 1, 4  # BufferAssignmentProto
_ID, _SIZE = 1, 2  # LogicalBufferProto
_EVENTS = 1  # HeapSimulatorTrace
_KIND, _BUFFER, _INSTRUCTION = 1, 2, 4  # HeapSimulatorTrace.Event
_ALLOC, _FREE, _SHARE_WITH = 0, 1, 2


def _varint(b: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = b[i]
        i += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, i


def _fields(b: bytes) -> list[tuple[int, int | bytes]]:
    """A message's ``(field number, value)`` pairs: varints as ints, the rest as bytes."""
    i, out = 0, []
    while i < len(b):
        key, i = _varint(b, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(b, i)
        elif wire == 2:
            n, i = _varint(b, i)
            value, i = b[i:i + n], i + n
        elif wire in (1, 5):
            n = 8 if wire == 1 else 4
            value, i = b[i:i + n], i + n
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        out.append((number, value))
    return out


def _get(fields: list, number: int, default=None) -> list:
    found = [v for n, v in fields if n == number]
    return found or ([] if default is None else [default])


@dataclass(frozen=True)
class HeapPeak:
    """``bytes`` live at the peak and the ``buffers`` then live, ``(instruction, bytes)``,
    largest first; ``event`` / ``events``: where in the trace the peak falls."""

    bytes: int
    buffers: list[tuple[str, int]]
    event: int
    events: int


def live_peak(path: str | os.PathLike) -> HeapPeak:
    """Replay the heap simulator's traces in a ``*after_optimizations.hlo.pb`` dump; the
    largest live set of any trace (GPU modules have one, for the whole module)."""
    found = _get(_fields(Path(path).read_bytes()), _BUFFER_ASSIGNMENT)
    if not found:  # e.g. an executable JAX loaded from its persistent compilation cache
        raise ValueError(f"{path} holds no buffer assignment: not a compiled module's dump")
    assignment = _fields(found[0])
    size = {}
    for buf in _get(assignment, _LOGICAL_BUFFERS):
        f = _fields(buf)
        size[_get(f, _ID, 0)[0]] = _get(f, _SIZE, 0)[0]
    best = HeapPeak(0, [], 0, 0)
    for trace in _get(assignment, _TRACES):
        events = _get(_fields(trace), _EVENTS)
        live: dict[int, tuple[str, int]] = {}
        total = 0
        for j, event in enumerate(events):
            f = _fields(event)
            kind, buf = _get(f, _KIND, 0)[0], _get(f, _BUFFER, 0)[0]
            # SHARE_WITH: an in-place result takes the space of an operand the trace has just
            # freed (e.g. the loss gradient written over the logits); it is live until its
            # own FREE, so it counts as an allocation (stop 32: ignoring it hid 3.07 GiB).
            if kind in (_ALLOC, _SHARE_WITH):
                live[buf] = (_get(f, _INSTRUCTION, b"")[0].decode(), size[buf])
                total += size[buf]
                if total > best.bytes:
                    best = HeapPeak(total, sorted(live.values(), key=lambda x: -x[1]), j,
                                    len(events))
            elif kind == _FREE and buf in live:
                total -= live.pop(buf)[1]
    return best


def newest_dump(folder: str | os.PathLike, module: str = "jit_step") -> Path:
    """The newest ``*{module}*after_optimizations.hlo.pb`` in ``folder``."""
    found = list(Path(folder).glob(f"*{module}*after_optimizations.hlo.pb"))
    if not found:
        raise FileNotFoundError(f"no {module} proto dump in {folder}")
    return max(found, key=os.path.getmtime)
