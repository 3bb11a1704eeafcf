"""jaxmp.hlo.heap: the live set at the peak, replayed from XLA's heap-simulator trace."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from jaxmp.hlo.heap import live_peak, newest_dump


def test_live_peak_names_the_buffers_the_heap_holds(tmp_path):
    """Two 256 KiB float32 intermediates live at once (their product needs both): the replayed
    peak holds them, and the heap XLA packs is at least that peak."""
    salt = 1.0 + len(str(tmp_path)) / 1e3 + id(tmp_path) % 997  # not in the persistent cache

    def f(x):
        a, b = jnp.sin(x * salt), jnp.cos(x)
        return (a @ b).sum() + (b @ a).sum()

    compiled = jax.jit(f).lower(jnp.ones((256, 256))).compile(
        compiler_options={"xla_dump_to": str(tmp_path), "xla_dump_hlo_as_proto": True})
    peak = live_peak(newest_dump(tmp_path, module="jit_f"))
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert 2 * 256 * 256 * 4 <= peak.bytes <= temp
    assert sum(size for _, size in peak.buffers) == peak.bytes
    assert peak.buffers[0][1] >= 256 * 256 * 4 and 0 <= peak.event < peak.events


def test_no_dump_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no jit_step proto dump"):
        newest_dump(tmp_path)


def _msg(*fields: tuple[int, int | bytes]) -> bytes:
    """A protobuf message from ``(field number, int | bytes)`` pairs (varints, bytes)."""
    def varint(n: int) -> bytes:
        out = b""
        while True:
            out += bytes([(n & 0x7F) | (0x80 if n > 0x7F else 0)])
            n >>= 7
            if not n:
                return out
    out = b""
    for number, value in fields:
        if isinstance(value, int):
            out += varint(number << 3) + varint(value)
        else:
            out += varint(number << 3 | 2) + varint(len(value)) + value
    return out


def test_an_in_place_result_sharing_a_freed_operand_stays_live(tmp_path):
    """XLA's trace frees an operand and then lets the in-place result SHARE_WITH its space
    (the loss gradient written over the logits, docs/planner.md §7 "Stop 32"): the result is
    live until its own FREE. Buffers: 1 (100 bytes, shared by 2 after it is freed), 3 (50)."""
    event = lambda kind, buf, share=0: _msg((1, kind), (2, buf), (4, b"op%d" % buf),  # noqa: E731
                                            *([(5, share)] if share else []))
    trace = _msg(*[(1, e) for e in (event(0, 1), event(1, 1), event(2, 2, share=1),
                                    event(0, 3), event(1, 3), event(1, 2))])
    buffers = [_msg((1, i), (2, size)) for i, size in ((1, 100), (2, 100), (3, 50))]
    assignment = _msg(*[(1, b) for b in buffers], (4, trace))
    path = tmp_path / "module.after_optimizations.hlo.pb"
    path.write_bytes(_msg((3, assignment)))
    peak = live_peak(path)
    assert peak.bytes == 150 and peak.buffers == [("op2", 100), ("op3", 50)]
