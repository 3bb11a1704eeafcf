"""The embedding lookup's gradient as jaxmp's GPT makes it (:mod:`jaxmp.models.lookup`): the
stream's gradient moves from batch to embed shards by an all-to-all over fsdp and is scattered
into each device's own columns of the table, so no table-sized gradient is made or
reduce-scattered. What that costs per microbatch, for the planner's layer table."""

from __future__ import annotations

IDS_ITEMSIZE = 4  # token ids are gathered as int32


def lookup_wire_bytes(fsdp: int, stream_grad: float, tokens: float) -> float:
    """Bytes one device sends for a sharded lookup's gradient per microbatch: the all-to-all
    of its ``stream_grad`` bytes and the gather of its ``tokens`` ids over ``fsdp``. (Its
    gradient is the table's own shard: no table-sized one, no reduce-scatter of it.)"""
    if fsdp <= 1:
        return 0.0
    return (fsdp - 1) / fsdp * stream_grad + (fsdp - 1) * IDS_ITEMSIZE * tokens
