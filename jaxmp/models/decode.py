"""Autoregressive decoding of the GPT with a KV cache, in one jitted loop.

The prompt is run through every layer once (prefill), writing each layer's keys and values into
a cache as long as the whole sample; then ``lax.fori_loop`` feeds one token at a time, each
attending to the cache under a causal mask. Everything else is the model's own code — its
parameters, RMSNorm and MLP modules, :meth:`~jaxmp.models.gpt.Attention.qkv` (projections,
biases, rotary embedding with its scaling), the same ``dot_product_attention`` — so greedy
decoding equals an argmax of the full forward pass at every step (a test checks it). Prompt,
cache and sampling all live in one compiled program.

Attention here is always XLA's, whatever the model trains with: a query block attends to a
cache longer than itself under a rectangular mask, which cuDNN's flash kernel does not take as a
causal mask (only as a bias, materialised), and decoding reads the cache once per token anyway.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmp.models.gpt import GPT, Attention

Cache = tuple[jax.Array, jax.Array]  # keys, values: [layers, batch, length, kv_heads, head_dim]


def init_cache(model: GPT, batch: int, length: int) -> Cache:
    cfg = model.cfg
    shape = (cfg.layers, batch, length, cfg.kv_heads, cfg.head_dim)
    zeros = jnp.zeros(shape, jnp.dtype(cfg.compute_dtype))
    return zeros, zeros


def _attend(attn: Attention, x: jax.Array, keys: jax.Array, values: jax.Array,
            pos: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``attn`` on ``x`` (tokens at ``pos``, ``pos + 1``, ...) with one layer's cache."""
    dt = x.dtype
    positions = pos + jnp.arange(x.shape[1])
    q, k, v = attn.qkv(x, positions)  # the model's own projections, biases and rope
    keys = jax.lax.dynamic_update_slice(keys, k, (0, pos, 0, 0))
    values = jax.lax.dynamic_update_slice(values, v, (0, pos, 0, 0))
    visible = jnp.arange(keys.shape[1])[None, :] <= positions[:, None]  # [new, cache length]
    out = jax.nn.dot_product_attention(q, keys, values, mask=visible[None, None],
                                       implementation="xla")
    return jnp.einsum("bshk,hkd->bsd", out, attn.o[...].astype(dt)), keys, values


def forward_cached(model: GPT, tokens: jax.Array, cache: Cache,
                   pos: jax.Array) -> tuple[jax.Array, Cache]:
    """Logits of ``tokens`` [batch, n] placed at ``pos ..``, and the cache with them added."""
    cfg = model.cfg
    dt = jnp.dtype(cfg.compute_dtype)
    x = jnp.take(model.embed[...], tokens, axis=0).astype(dt)
    graphdef, stacked = nnx.split(model.blocks)

    def layer(h: jax.Array, xs) -> tuple[jax.Array, Cache]:
        state, keys, values = xs
        block = nnx.merge(graphdef, state)
        a, keys, values = _attend(block.attn, block.attn_norm(h), keys, values, pos)
        h = h + a
        return h + block.mlp(block.mlp_norm(h)), (keys, values)

    x, cache = jax.lax.scan(layer, x, (stacked, *cache))
    x = model.final_norm(x)
    head = model.embed[...].T if cfg.tie_embeddings else model.unembed[...]
    return x @ head.astype(dt), cache


def _pick(logits: jax.Array, key: jax.Array, temperature: jax.Array, top_k: int | None,
          vocab_limit: int | None) -> jax.Array:
    """Next token per row: argmax when ``temperature`` is None, else a softmax sample."""
    logits = logits.astype(jnp.float32)
    if vocab_limit is not None and vocab_limit < logits.shape[-1]:  # padding ids: never emitted
        logits = jnp.where(jnp.arange(logits.shape[-1]) < vocab_limit, logits, -jnp.inf)
    if temperature is None:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_k is not None:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@partial(jax.jit, static_argnums=0, static_argnames=("new_tokens", "top_k", "vocab_limit"))
def _generate(graphdef: nnx.GraphDef, state: nnx.State, prompt: jax.Array, key: jax.Array,
              temperature: jax.Array | None, *, new_tokens: int, top_k: int | None,
              vocab_limit: int | None) -> jax.Array:
    model = nnx.merge(graphdef, state)
    batch, n_prompt = prompt.shape
    cache = init_cache(model, batch, n_prompt + new_tokens)
    logits, cache = forward_cached(model, prompt, cache, jnp.int32(0))
    pick = partial(_pick, temperature=temperature, top_k=top_k, vocab_limit=vocab_limit)
    out = jnp.zeros((batch, new_tokens), jnp.int32)
    out = out.at[:, 0].set(pick(logits[:, -1], jax.random.fold_in(key, 0)))

    def step(i: jax.Array, carry: tuple[jax.Array, Cache]) -> tuple[jax.Array, Cache]:
        out, cache = carry
        last = jax.lax.dynamic_slice_in_dim(out, i - 1, 1, axis=1)
        logits, cache = forward_cached(model, last, cache, n_prompt + i - 1)
        return out.at[:, i].set(pick(logits[:, -1], jax.random.fold_in(key, i))), cache

    out, _ = jax.lax.fori_loop(1, new_tokens, step, (out, cache))
    return out


def generate(model: GPT, prompt: jax.Array, key: jax.Array, new_tokens: int,
             temperature: float = 1.0, top_k: int | None = None,
             vocab_limit: int | None = None) -> jax.Array:
    """``new_tokens`` tokens after each row of ``prompt`` [batch, n] (int32 [batch, new]).

    ``temperature`` 0 is greedy (deterministic); otherwise logits are divided by it and, with
    ``top_k``, cut to the k most likely before sampling. ``vocab_limit``: ids at or above it
    (a vocabulary padded past the tokenizer's) are never emitted.
    """
    if new_tokens < 1:
        raise ValueError(f"new_tokens must be >= 1, got {new_tokens}")
    graphdef, state = nnx.split(model)
    temp = None if temperature == 0 else jnp.float32(temperature)
    return _generate(graphdef, state, jnp.asarray(prompt, jnp.int32), key, temp,
                     new_tokens=new_tokens, top_k=top_k, vocab_limit=vocab_limit)
