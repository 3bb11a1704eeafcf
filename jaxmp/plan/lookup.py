"""The embedding lookup's gradient as jaxmp's GPT makes it (:mod:`jaxmp.models.lookup`): the
stream's gradient moves from batch to embed shards by an all-to-all over fsdp and is scattered
into each device's own columns of the table, so no table-sized gradient is made or
reduce-scattered. What that costs per microbatch, for the planner's layer table."""

from __future__ import annotations

IDS_ITEMSIZE = 4  # token ids are gathered as int32


def lookup_gradient(local: float, fsdp: int, stream_grad: float, rows: float,
                    seq_len: int) -> tuple[float, float]:
    """``(wire bytes, held bytes)`` of a sharded lookup's gradient on one device: the
    all-to-all of its ``stream_grad`` bytes and the gather of ``rows`` x ``seq_len`` token ids
    over ``fsdp``, and the gradient it accumulates (the table's ``local`` shard). Replaces
    the table's reduce-scatter and its full-size gradient."""
    if fsdp <= 1:
        return 0.0, local
    ids = IDS_ITEMSIZE * rows * seq_len
    return (fsdp - 1) / fsdp * stream_grad + (fsdp - 1) * ids, local
