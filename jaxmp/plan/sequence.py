"""Sequence parallelism's collectives beyond the all-reduces it replaces, per layer.

With sequence parallelism (:mod:`jaxmp.sharding.sequence`) each tensor all-reduce of a
layer's activations becomes a reduce-scatter plus an all-gather: the same bytes, which the
planner's tensor term already counts. What it does not replace: a column-parallel matmul
reads the *gathered* input, but the step keeps only the sequence-sharded one for the
backward pass, so the weight gradient (``input^T · output gradient``) needs the input
gathered again — one more all-gather of ``(t-1)/t`` of the layer's input per distinct input
of its column-parallel matmuls (a block: q/k/v's and the MLP's; the head: its own).

Measured (docs/planner.md §7, ``jaxmp plan --verify --aot``): XLA's GPU compiler emits exactly
those all-gathers (a 4-block 2048-wide GPT on 8 × H100, tensor 8: 2 per block + 1 for the
head). Megatron-LM does the same and overlaps it with the input-gradient matmul (Korthikanti
et al. 2022, §4.2.2); keeping the gathered input instead would store ``t`` times the
sequence-sharded one per column input, most of what sequence parallelism saves. XLA:CPU,
which reduces each column matrix's input gradient separately, sends no extra bytes (CPU
bytes with and without sequence parallelism agree within 2 %, docs/benchmarks.md); inside a
pipeline's ticks the GPU compiler does not reassociate either, and no extra gather is
counted there (unmeasured: the tick programs' other terms are not yet isolated).
"""

from __future__ import annotations


def regathers(column_inputs: int, *, sp: bool, tensor: int, reassociates: bool,
              staged: bool) -> int:
    """All-gathers of a layer's saved, sequence-sharded input that its backward pass adds
    under sequence parallelism (``column_inputs``: the distinct inputs of its column-parallel
    matmuls; ``reassociates``: the backend sums their input gradients before one reduction —
    :attr:`jaxmp.devices.DeviceProfile.reassociates_all_reduce`; ``staged``: inside a
    pipeline's ticks)."""
    if not sp or tensor <= 1 or not reassociates or staged:
        return 0
    return column_inputs


def regather_bytes(column_inputs: int, io: float, *, sp: bool, tensor: int,
                   reassociates: bool, staged: bool = False) -> float:
    """Bytes each device sends for :func:`regathers` all-gathers of an input of ``io`` bytes
    (whole sequence, per device's rows): ``(t-1)/t · io`` each."""
    n = regathers(column_inputs, sp=sp, tensor=tensor, reassociates=reassociates,
                  staged=staged)
    return n * (tensor - 1) / tensor * io
