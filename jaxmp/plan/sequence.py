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
bytes with and without sequence parallelism agree within 2 %, docs/benchmarks.md). Inside a
pipeline's ticks the same gathers are counted, and the GPU program sends them: until stop 35
the partitioner gave each matmul reading the split stream (q, k, v; a row matmul's two
backward products) an all-gather of its own, +50 % bytes at 530B's width, in stages or not;
the step now gathers each once (:func:`jaxmp.sharding.ring.gathered_once`, docs/planner.md §7).

When it pays (:func:`choices`): ``"auto"`` tries it off and on and the search keeps the faster
(on a tie the smaller) — on GPUs it costs the gathers above, on the CPU nothing; and never
where ``tensor`` leaves one of a block's matrices whole (more tensor devices than heads):
those weights' gradients become partial sums over the sequence shards, reduced over
``tensor``, and their inputs and outputs are gathered — measured on the tiny default GPT (4
heads) at tensor 8 on 64 × H100, 25.1 MiB per device against 3.2 without it.
"""

from __future__ import annotations

from jaxmp.plan.layout import sequence_parallel


def regathers(column_inputs: int, *, sp: bool, tensor: int, reassociates: bool) -> int:
    """All-gathers of a layer's saved, sequence-sharded input that its backward pass adds
    under sequence parallelism (``column_inputs``: the distinct inputs of its column-parallel
    matmuls; ``reassociates``: the backend sums their input gradients before one reduction —
    :attr:`jaxmp.devices.DeviceProfile.reassociates_all_reduce`, the GPU compiler's; inside
    a pipeline's ticks counted alike)."""
    if not sp or tensor <= 1 or not reassociates:
        return 0
    return column_inputs


def regather_bytes(column_inputs: int, io: float, *, sp: bool, tensor: int,
                   reassociates: bool) -> float:
    """Bytes each device sends for :func:`regathers` all-gathers of an input of ``io`` bytes
    (whole sequence, per device's rows): ``(t-1)/t · io`` each."""
    n = regathers(column_inputs, sp=sp, tensor=tensor, reassociates=reassociates)
    return n * (tensor - 1) / tensor * io


def choices(setting: bool | str, tensor: int, seq_len: int | None,
            splits_every_matrix: bool) -> tuple[bool, ...]:
    """The values of ``Layout.sequence_parallel`` the search tries for
    ``train.sequence_parallel = setting`` on ``tensor`` devices (``seq_len``: the sequence
    length sequence parallelism could split, None: the model names none;
    ``splits_every_matrix``: ``tensor`` splits every weight matrix of a block). The last is
    the one a layout takes when nothing chooses."""
    on = sequence_parallel(setting, tensor, seq_len)
    if setting != "auto" or not on:
        return (on,)
    return (False, True) if splits_every_matrix else (False,)
