"""The embedding lookup whose gradient scatters where the table's shards are: for the
pipeline's first chunk, whose backward runs inside a tick's ``lax.cond``.

Differentiated as JAX does it, the lookup's gradient is a scatter-add of the stream's gradient
``[batch, seq, embed]`` (batch split over fsdp) into the table; the partitioner all-gathers
that gradient and the token ids over fsdp, then scatters into a table replicated over fsdp and
slices it to the param's shards. Inside the pipeline's backward tick those two gathers sat in
the conditional, where XLA's scheduler overlaps nothing with them: the 4 exposed loop
all-gathers of ``70b-stages`` (docs/planner.md §7, stop 32). :func:`sharded_lookup` instead
moves the gradient's fsdp split from its batch to its embed dim (an all-to-all: ``1/fsdp`` of
the gather's bytes) and scatters each device's embed columns into its own shard of the table,
reading ids its caller gathered over fsdp once per step (:attr:`PipelineSpec.token_ids`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxmp.sharding import constrain
from jaxmp.sharding.activations import gathered, moved

TOKENS = ("batch", None)  # the lookup runs over the whole sequence, as embed_tokens does
STREAM_GRAD = ("batch", None, "act_embed")


def sharded_lookup(table: jax.Array, tokens: jax.Array, table_names: Any,
                   dtype: Any) -> jax.Array:
    """``table[tokens]`` in ``dtype`` (``table`` used whole, as an activation ``("act_vocab",
    "act_embed")``) whose gradient moves in ``dtype`` and is made in the sharding of
    ``table_names`` (the param's logical names), summed in the table's dtype as JAX's own
    gradient is."""

    @jax.custom_vjp
    def lookup(table: jax.Array, tokens: jax.Array) -> jax.Array:
        return jnp.take(constrain(table, ("act_vocab", "act_embed")),
                        constrain(tokens, TOKENS), axis=0).astype(dtype)

    def forward(table: jax.Array, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        # The ids kept as they came: constrained here, inside the pipeline's first-chunk
        # conditional, they gave its branches different shardings (XLA:CPU's verifier failed
        # under sequence parallelism); the backward pins them whole.
        return lookup(table, tokens), tokens

    def backward(ids: jax.Array, grad: jax.Array) -> tuple[jax.Array, None]:
        grad = moved(grad, STREAM_GRAD, dim=2)  # [batch, seq, embed / fsdp]
        ids = gathered(ids, TOKENS)
        table_grad = jnp.zeros(table.shape, table.dtype).at[ids].add(grad.astype(table.dtype))
        return constrain(table_grad, table_names), None

    lookup.defvjp(forward, backward)
    return lookup(table, tokens)
