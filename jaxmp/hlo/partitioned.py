"""The program as the SPMD partitioner left it, before a backend widens narrow collectives.

XLA's CPU backend runs ``float-normalization-bf16`` after partitioning: every bf16 collective
(a bf16 weight all-gather, a bf16 gradient reduce-scatter) becomes a float32 one, because the
CPU runtime has no bf16 arithmetic. GPUs and TPUs keep them bf16. To check on a CPU-only
machine what an accelerator would send, :func:`partitioned_text` compiles a lowered program
once more with XLA's pass dumps on and returns the module just before that pass (or, on a
backend without it, right after SPMD partitioning). Read it with
:func:`jaxmp.hlo.collective_stats`.
"""
from __future__ import annotations

import tempfile
import uuid
from pathlib import Path
from typing import Any

import jax

_BEFORE = "before_float-normalization-bf16"
_AFTER_SPMD = "after_spmd-partitioning"


def partitioned_text(lowered: Any) -> str:
    """HLO text of ``lowered`` (a ``jax.stages.Lowered``) after partitioning, before the
    backend widens bf16 collectives (see the module docstring)."""
    # A persistent-cache hit runs no passes (so dumps nothing), and JAX decides once per
    # process whether the cache is used. The cache key leaves out the dump options but keeps
    # the other debug options: a fresh value of one that changes no code (how many buffers a
    # buffer-assignment debug print shows) makes this compile miss, and the raised minimum
    # compile time keeps it out of the cache.
    nonce = uuid.uuid4().int % 2**30 + 1
    min_time = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1e9)
    try:
        with tempfile.TemporaryDirectory(prefix="jaxmp-hlo-") as tmp:
            lowered.compile(compiler_options={
                "xla_dump_to": tmp, "xla_dump_hlo_as_text": True,
                "xla_dump_hlo_pass_re": "spmd-partitioning|all-reduce-promotion|"
                                        "float-normalization",
                "xla_debug_buffer_assignment_show_max": nonce,
                # only the HLO text is wanted: skip the backend's code optimization (half the
                # compile time; the partitioned module is the same text)
                "xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True})
            files = sorted(Path(tmp).glob("*.txt"))
            texts = {f.name: f.read_text() for f in files}
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", min_time)
    for tag in (_BEFORE, _AFTER_SPMD):
        found = [name for name in sorted(texts) if tag in name]
        if found:
            return texts[found[-1]]
    raise RuntimeError("XLA wrote no partitioned module (its pass names may have changed)")
