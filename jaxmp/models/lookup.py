"""The GPT's embedding lookup, whose gradient is made in the table's own shards.

Differentiated as JAX does it, the lookup's gradient is a scatter-add of the stream's gradient
``[batch, seq, embed]`` (batch split over fsdp) into the table. The partitioner then either
scatters into a whole table on every device and reduce-scatters it over fsdp (a table-sized
gradient per device, the table's bytes on the wire), or all-gathers the stream's gradient and
the token ids over fsdp (data × fsdp; in a pipeline's backward tick, inside the conditional
where nothing overlaps them: the 4 exposed loop all-gathers of ``70b-stages``, docs/planner.md
§7, stop 32). :func:`sharded_lookup` moves the gradient's fsdp split from its batch to its
embed dim (an all-to-all: ``1/fsdp`` of the gather's bytes) and scatters each device's embed
columns into its own shard, with the ids gathered over fsdp (a pipeline gathers them once per
step, :attr:`PipelineSpec.token_ids`). The planner's term: :mod:`jaxmp.plan.lookup`.
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
    ``table_names`` (the param's logical names), summed in float32."""

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
        # Summed in float32 and rounded once, as a matmul's weight gradient is: the table may
        # be the step's 16-bit copy, and a frequent token's rows add up hundreds of terms.
        table_grad = jnp.zeros(table.shape, jnp.float32).at[ids].add(grad.astype(jnp.float32))
        return constrain(table_grad.astype(table.dtype), table_names), None

    lookup.defvjp(forward, backward)
    return lookup(table, tokens)
