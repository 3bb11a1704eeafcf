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
from pathlib import Path
from typing import Any

import jax

_BEFORE = "before_float-normalization-bf16"
_AFTER_SPMD = "after_spmd-partitioning"


def partitioned_text(lowered: Any) -> str:
    """HLO text of ``lowered`` (a ``jax.stages.Lowered``) after partitioning, before the
    backend widens bf16 collectives (see the module docstring)."""
    cached = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)  # a cache hit runs no passes
    try:
        with tempfile.TemporaryDirectory(prefix="jaxmp-hlo-") as tmp:
            lowered.compile(compiler_options={
                "xla_dump_to": tmp, "xla_dump_hlo_as_text": True,
                "xla_dump_hlo_pass_re": "spmd-partitioning|all-reduce-promotion|"
                                        "float-normalization"})
            files = sorted(Path(tmp).glob("*.txt"))
            texts = {f.name: f.read_text() for f in files}
    finally:
        jax.config.update("jax_enable_compilation_cache", cached)
    for tag in (_BEFORE, _AFTER_SPMD):
        found = [name for name in sorted(texts) if tag in name]
        if found:
            return texts[found[-1]]
    raise RuntimeError("XLA wrote no partitioned module (its pass names may have changed)")
