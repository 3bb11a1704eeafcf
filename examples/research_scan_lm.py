"""A second research model written the ordinary Flax NNX way: Llama-style blocks stacked with
``nnx.vmap`` and run with ``nnx.scan`` (Flax's "scan over layers"), grouped-query attention
through ``jax.nn.dot_product_attention``, RMSNorm, SwiGLU, tied embeddings (``nnx.Embed.attend``).

Parameters carry ``nnx.with_partitioning`` in the model's own names (``emb``, ``ff``, ``qh``,
``kvh``, ``tok``); ``RULES`` maps them onto jaxmp's mesh axes and keeps jaxmp's defaults. The
residual stream is named with :func:`jaxmp.rules.constrain` (``batch``, ``seq``, ``act_embed``),
the one thing a model does for jaxmp's sequence parallelism; outside a trainer it is the
identity. Used by tests/test_research_scan.py; tiny on purpose (2 layers, D 128).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import jaxmp
from jaxmp import rules

VOCAB, D_MODEL, HEADS, KV_HEADS, HEAD_DIM, LAYERS, FF = 256, 128, 8, 2, 16, 2, 256

RULES = [("emb", "fsdp"), ("ff", "tensor"), ("qh", "tensor"), ("kvh", "tensor"),
         ("tok", "tensor"), ("ff", "fsdp"), ("qh", "fsdp"), ("kvh", "fsdp"), ("tok", "fsdp"),
         *rules.DEFAULT_RULES]
RESIDUAL = ("batch", "seq", "act_embed")

init = nnx.initializers.lecun_normal()


def linear(n_in: int, n_out: int, names: tuple[str, str], rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(n_in, n_out, use_bias=False,
                      kernel_init=nnx.with_partitioning(init, names), rngs=rngs)


def rms_norm(rngs: nnx.Rngs) -> nnx.RMSNorm:
    return nnx.RMSNorm(D_MODEL, scale_init=nnx.with_partitioning(nnx.initializers.ones_init(),
                                                                 ("emb",)), rngs=rngs)


def rope(x: jax.Array) -> jax.Array:
    """Rotary position embedding on [batch, seq, heads, head_dim]."""
    half = x.shape[-1] // 2
    freq = 1.0 / 10000 ** (jnp.arange(half, dtype=jnp.float32) / half)
    angle = jnp.arange(x.shape[1], dtype=jnp.float32)[:, None] * freq
    cos, sin = jnp.cos(angle)[None, :, None], jnp.sin(angle)[None, :, None]
    a, b = x[..., :half], x[..., half:]
    return jnp.concatenate([a * cos - b * sin, a * sin + b * cos], -1).astype(x.dtype)


class Block(nnx.Module):
    """Pre-norm Llama block: GQA self-attention, then a SwiGLU MLP."""

    def __init__(self, rngs: nnx.Rngs):
        self.attn_norm = rms_norm(rngs)
        self.q = linear(D_MODEL, HEADS * HEAD_DIM, ("emb", "qh"), rngs)
        self.k = linear(D_MODEL, KV_HEADS * HEAD_DIM, ("emb", "kvh"), rngs)
        self.v = linear(D_MODEL, KV_HEADS * HEAD_DIM, ("emb", "kvh"), rngs)
        self.o = linear(HEADS * HEAD_DIM, D_MODEL, ("qh", "emb"), rngs)
        self.mlp_norm = rms_norm(rngs)
        self.gate = linear(D_MODEL, FF, ("emb", "ff"), rngs)
        self.up = linear(D_MODEL, FF, ("emb", "ff"), rngs)
        self.down = linear(FF, D_MODEL, ("ff", "emb"), rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, _ = x.shape
        h = self.attn_norm(x)
        q = rope(self.q(h).reshape(b, t, HEADS, HEAD_DIM))
        k = rope(self.k(h).reshape(b, t, KV_HEADS, HEAD_DIM))
        v = self.v(h).reshape(b, t, KV_HEADS, HEAD_DIM)
        a = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        x = rules.constrain(x + self.o(a.reshape(b, t, HEADS * HEAD_DIM)), RESIDUAL)
        h = self.mlp_norm(x)
        h = self.down(nnx.silu(self.gate(h)) * self.up(h))
        return rules.constrain(x + h, RESIDUAL)


class ScanLM(nnx.Module):
    """Tied token embedding → scanned blocks → RMSNorm → ``embed.attend`` logits."""

    def __init__(self, rngs: nnx.Rngs, layers: int = LAYERS):
        self.embed = nnx.Embed(VOCAB, D_MODEL, rngs=rngs, embedding_init=nnx.with_partitioning(
            nnx.initializers.normal(0.02), ("tok", "emb")))

        @nnx.split_rngs(splits=layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_blocks(rngs: nnx.Rngs) -> Block:
            return Block(rngs)

        self.blocks = make_blocks(rngs)
        self.norm = rms_norm(rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = rules.constrain(self.embed(tokens), RESIDUAL)

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry,
                  transform_metadata={nnx.PARTITION_NAME: "layers"})
        def forward(x: jax.Array, block: Block) -> jax.Array:
            return block(x)

        return self.embed.attend(self.norm(forward(x, self.blocks)))


def lm_loss(model: ScanLM, batch: dict) -> tuple[jax.Array, dict]:
    logits = model(batch["inputs"]).astype(jnp.float32)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()
    return loss, {"weight": jnp.float32(batch["targets"].size)}


DEFAULTS = ["train.batch_size=16", "data.seq_len=64", "train.eval_every=0", "optimizer.lr=3e-3",
            "optimizer.warmup_steps=5"]


def make_config(steps: int, overrides: list[str] = ()) -> jaxmp.Config:
    return jaxmp.load_config(None, overrides=[*DEFAULTS, f"train.steps={steps}", *overrides])


def make_trainer(config: jaxmp.Config, run_dir: str, devices=None) -> jaxmp.Trainer:
    d, t = config.data, config.train
    data = jaxmp.data.make_batches(d.source, seq_len=d.seq_len, global_batch=t.batch_size,
                                   seed=t.seed, vocab_size=VOCAB)
    return jaxmp.Trainer(config, model_fn=lambda r: ScanLM(r), loss_fn=lm_loss, data=data,
                         rules=RULES, run_dir=run_dir, devices=devices)
