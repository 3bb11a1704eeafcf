"""Sequence parallelism (Korthikanti et al. 2022) as a rule list: the residual stream's
sequence dim sharded over ``tensor``.

With tensor parallelism alone, the activations between the attention and MLP regions (norms,
residual adds, dropout) are replicated over ``tensor``: every device of a tensor group holds
and computes the whole ``[batch, seq, embed]`` stream. Sequence parallelism splits them along
the sequence over the same devices, so their bytes divide by ``tensor``; the block's
all-reduces become a reduce-scatter (into the sequence shards) and an all-gather (before the
next column-parallel matmul) — the same bytes on the wire.

jaxmp needs no model change for it: models name the sequence dim ``seq`` in their activation
constraints (``constrain(x, ("batch", "seq", "act_embed"))``), and this module returns the rule
list in which ``seq`` maps to ``tensor`` *last*. Rules are resolved first free match in rule
order (:mod:`jaxmp.sharding.resolve`), so inside attention and the MLP the wide dims
(``act_heads``, ``act_mlp``, ``act_vocab``) claim ``tensor`` first and their ``seq`` stays
whole; only arrays where nothing else took ``tensor`` — the residual stream — get it on their
sequence. Any Flax model that constrains its activations with these names benefits alike.
Only activation constraints use this list; parameters keep the plain rules.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from jaxmp.sharding.resolve import Rule, normalize_rules, resolve

SEQ = "seq"  # the logical name of an activation's sequence dim
AXIS = "tensor"  # the mesh axis sequence parallelism shards it over
_PROBE = ("batch", SEQ, "act_embed")  # a residual-stream activation, to read the rules back


def sequence_parallel_rules(rules: Sequence[Rule]) -> tuple[Rule, ...]:
    """``rules`` with the sequence dim of activations sharded over ``tensor`` where no other
    dim of the same array uses it: ``("seq", None)`` (explicit replication) dropped and
    ``("seq", "tensor")`` appended last. Rules mapping ``seq`` to other axes (context
    parallelism) keep their place and win; idempotent."""
    rules = normalize_rules(rules)
    if (SEQ, AXIS) in rules:
        return rules
    return tuple(r for r in rules if r != (SEQ, None)) + ((SEQ, AXIS),)


def shards_sequence(rules: Sequence[Rule], sizes: Mapping[str, int], seq_len: int = 0) -> bool:
    """Whether ``rules`` shard a residual-stream activation's sequence over ``tensor`` on a
    mesh of ``sizes`` (``seq_len``: its length; 0 — any multiple of ``tensor``): what a step
    built with these rules does, read back from the rules themselves."""
    tensor = int(sizes.get(AXIS, 1))
    if tensor <= 1:
        return False
    length = seq_len or tensor
    spec = resolve(_PROBE, (tensor, length, 1), dict(sizes), normalize_rules(rules)).spec
    entry = spec[1] if len(spec) > 1 else None
    return entry == AXIS or (isinstance(entry, tuple) and AXIS in entry)
