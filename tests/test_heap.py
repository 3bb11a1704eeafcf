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
