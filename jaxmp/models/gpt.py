"""A decoder-only transformer (GPT / Llama style) in Flax NNX, read in one sitting.

Every parameter names its logical axes (``("embed", "mlp")``); activations are constrained by
logical name through ``jaxmp.rules.constrain``. No mesh axis appears here: where things live is
decided by the rules and the planner, so the same model runs on any mesh.

Layers are created stacked (a leading ``layers`` axis, via ``nnx.vmap``) and run either with
``jax.lax.scan`` (one compiled block: fast compiles) or unrolled (one block per layer in the
program: what per-layer cost measurements and some XLA schedules want). Both modes share one
parameter layout, so checkpoints do not care which was used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxmp.gradsum import scan_layers
from jaxmp.models.attention import attend
from jaxmp.models.lookup import sharded_lookup
from jaxmp.models.vjp import recomputed, weight_grad_first
from jaxmp.remat import (ATTENTION_OUT, ATTENTION_SCOPE, KEY, MLP_IN, MLP_OUT, QUERY, VALUE,
                         checkpointed)
from jaxmp.sharding import constrain, constrain_param, names_of, splits
from jaxmp.sharding.ring import column_matmul, row_matmul

# Logical names of the activations around the tensor-parallel projections.
STREAM = ("batch", "seq", "act_embed")  # the residual stream (sequence-split under SP)
HEADS = ("batch", "seq", "act_heads", None)
KV_HEADS = ("batch", "seq", "act_kv_heads", None)
WIDE = ("batch", "seq", "act_mlp")
# ... and of the projections' weights.
TO_HEADS, TO_KV_HEADS = ("embed", "heads", "head_dim"), ("embed", "kv_heads", "head_dim")
FROM_HEADS, TO_MLP, FROM_MLP = ("heads", "head_dim", "embed"), ("embed", "mlp"), ("mlp", "embed")

@dataclass(frozen=True)
class GPTConfig:
    """Resolved model hyper-parameters (no zeros meaning 'default' left)."""

    vocab_size: int = 256
    layers: int = 4
    d_model: int = 128
    heads: int = 4
    kv_heads: int = 4
    head_dim: int = 32
    mlp_dim: int = 512
    activation: str = "gelu"  # "gelu" | "swiglu"
    tie_embeddings: bool = True
    scan_layers: bool = True
    remat: str = "none"  # a jaxmp.remat.REMAT_POLICIES name
    attention: str = "xla"  # "xla" | "cudnn" (resolved: jaxmp.models.attention.choose_attention)
    compute_dtype: str = "float32"
    param_dtype: str = "float32"
    norm_eps: float = 1e-5
    init_std: float = 0.02
    # Rotary embedding: base, and Llama 3.1's frequency rescaling ("llama3") for long contexts.
    rope_theta: float = 10000.0
    rope_scaling: str = "none"  # "none" | "llama3"
    rope_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_positions: int = 8192
    qkv_bias: bool = False  # biases on the q, k, v projections (Qwen2)
    # tensor-parallel projections under sequence parallelism as ring collective matmuls
    # (jaxmp.sharding.ring); "auto": on GPU meshes
    collective_matmul: bool | str = False

    @property
    def n_params(self) -> int:
        """Parameter count, from the shapes the modules below create."""
        attn = self.d_model * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = self.d_model * self.mlp_dim * (3 if self.activation == "swiglu" else 2)
        bias = (self.heads + 2 * self.kv_heads) * self.head_dim if self.qkv_bias else 0
        block = attn + mlp + bias + 2 * self.d_model
        head = 0 if self.tie_embeddings else self.vocab_size * self.d_model
        return self.layers * block + self.vocab_size * self.d_model + head + self.d_model

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6·(matmul params) plus causal attention (fwd+bwd).

        Biases and norm scales are elementwise, not matmuls: they add no counted FLOPs."""
        attn = self.d_model * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = self.d_model * self.mlp_dim * (3 if self.activation == "swiglu" else 2)
        # The embedding lookup is a gather, not a matmul; the output head (tied or not) is one.
        matmul_params = self.layers * (attn + mlp) + self.vocab_size * self.d_model
        attn_flops = 6 * 2 * self.layers * self.heads * self.head_dim * seq_len  # QK^T and AV, full square
        return 6 * matmul_params + attn_flops


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], names: tuple[str | None, ...],
           std: float, dtype: jnp.dtype) -> nnx.Param:
    """A normal-initialised parameter carrying its logical axis names as metadata."""
    value = std * jax.random.normal(rngs.params(), shape, dtype)
    return nnx.Param(value, out_sharding=names, eager_sharding=False)


def _bias(shape: tuple[int, ...], names: tuple[str | None, ...], dtype: jnp.dtype) -> nnx.Param:
    return nnx.Param(jnp.zeros(shape, dtype), out_sharding=names, eager_sharding=False)


class RMSNorm(nnx.Module):
    """``recompute``: the backward pass recomputes the norm from its input (:func:`recomputed`;
    a block's norms, which a layer scan would otherwise store in float32)."""

    def __init__(self, dim: int, eps: float, dtype: jnp.dtype, recompute: bool = False):
        self.scale = nnx.Param(jnp.ones((dim,), dtype), out_sharding=("norm",),
                               eager_sharding=False)
        self.eps = eps
        self.recompute = recompute

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.recompute:
            return recomputed(_rms_norm, self.eps)(x, self.scale[...])
        return _rms_norm(x, self.scale[...], self.eps)


def _rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (normed * scale).astype(x.dtype)


def _swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    return jax.nn.silu(gate) * up


def _weights(x: jax.Array, *params: nnx.Param) -> tuple[jax.Array, ...]:
    return tuple(p[...].astype(x.dtype) for p in params)


def _heads(x: jax.Array, *weights: jax.Array) -> tuple[jax.Array, ...]:
    """The stream projected by each ``[embed, heads, head_dim]`` weight."""
    return tuple(jnp.einsum("bsd,dhk->bshk", x, w) for w in weights)


def _merge_heads(out: jax.Array, o: jax.Array) -> jax.Array:
    return jnp.einsum("bshk,hkd->bsd", out, o)


def _matmuls(x: jax.Array, *weights: jax.Array) -> tuple[jax.Array, ...]:
    return tuple(x @ w for w in weights)


def rope_frequencies(half: int, cfg: GPTConfig | None = None) -> jax.Array:
    """The ``half`` rotary inverse frequencies, float32: ``theta^(-i/half)``, rescaled as
    Llama 3.1 does when ``cfg.rope_scaling == "llama3"`` (HF's ``_compute_llama3_parameters``):
    wavelengths beyond ``original_max / low_freq_factor`` are slowed by ``factor``, those
    below ``original_max / high_freq_factor`` kept, and the band between interpolated."""
    theta = 10000.0 if cfg is None else cfg.rope_theta
    freqs = 1.0 / (theta ** (jnp.arange(half, dtype=jnp.float32) / half))
    if cfg is None or cfg.rope_scaling == "none":
        return freqs
    factor, low, high = cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    old = cfg.rope_original_max_positions
    wavelen = 2 * math.pi / freqs
    scaled = jnp.where(wavelen > old / low, freqs / factor, freqs)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old / high) & (wavelen <= old / low)
    return jnp.where(medium, smoothed, scaled)


def rope(x: jax.Array, positions: jax.Array, freqs: jax.Array | None = None) -> jax.Array:
    """Rotary position embedding over the last axis of ``x`` [batch, seq, heads, head_dim].

    The two halves of each head are rotated (HF Llama's ``rotate_half``); ``freqs`` default to
    base 10000 without scaling (see :func:`rope_frequencies`)."""
    half = x.shape[-1] // 2
    freqs = rope_frequencies(half) if freqs is None else freqs
    angles = positions[:, None].astype(jnp.float32) * freqs[None, :]  # [seq, half]
    sin, cos = jnp.sin(angles)[None, :, None, :], jnp.cos(angles)[None, :, None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class Attention(nnx.Module):
    """Causal multi-head attention; grouped-query when kv_heads < heads. ``cfg.attention``
    picks XLA's kernel or cuDNN's flash attention (same maths, same parameters)."""

    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
        d, h, kv, hd, pd = cfg.d_model, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.param_dtype
        std = cfg.init_std
        self.implementation = cfg.attention
        self.q = _param(rngs, (d, h, hd), TO_HEADS, std, pd)
        self.k = _param(rngs, (d, kv, hd), TO_KV_HEADS, std, pd)
        self.v = _param(rngs, (d, kv, hd), TO_KV_HEADS, std, pd)
        # GPT-2's scaled init for projections that write into the residual stream.
        self.o = _param(rngs, (h, hd, d), FROM_HEADS, std / math.sqrt(2 * cfg.layers), pd)
        if cfg.qkv_bias:  # zero at init; an imported model (Qwen2) brings its own
            self.q_bias = _bias((h, hd), ("heads", "head_dim"), pd)
            self.k_bias = _bias((kv, hd), ("kv_heads", "head_dim"), pd)
            self.v_bias = _bias((kv, hd), ("kv_heads", "head_dim"), pd)
        self.cfg = cfg

    def qkv(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Queries, keys and values of ``x`` at ``positions``, rotary embedding applied (the
        full forward pass and the KV-cached decode share it)."""
        dt = x.dtype
        q, k, v = column_matmul(_heads, x, _weights(x, self.q, self.k, self.v), STREAM,
                                (TO_HEADS, TO_KV_HEADS, TO_KV_HEADS),
                                (HEADS, KV_HEADS, KV_HEADS), self.cfg.collective_matmul)
        if self.cfg.qkv_bias:
            q = q + self.q_bias[...].astype(dt)
            k = k + self.k_bias[...].astype(dt)
            v = v + self.v_bias[...].astype(dt)
        q, k, v = constrain(q, HEADS), constrain(k, KV_HEADS), constrain(v, KV_HEADS)
        q, k, v = checkpoint_name(q, QUERY), checkpoint_name(k, KEY), checkpoint_name(v, VALUE)
        freqs = rope_frequencies(q.shape[-1] // 2, self.cfg)
        return rope(q, positions, freqs), rope(k, positions, freqs), v

    def __call__(self, x: jax.Array) -> jax.Array:
        q, k, v = self.qkv(x, jnp.arange(x.shape[1]))
        with jax.named_scope(ATTENTION_SCOPE):  # the cost model counts XLA's S x S traffic by it
            out = attend(q, k, v, self.implementation)
        out = constrain(out, HEADS)
        return checkpoint_name(row_matmul(_merge_heads, out, _weights(out, self.o), HEADS,
                                          (FROM_HEADS,), STREAM, self.cfg.collective_matmul),
                               ATTENTION_OUT)


class MLP(nnx.Module):
    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
        d, f, pd, std = cfg.d_model, cfg.mlp_dim, cfg.param_dtype, cfg.init_std
        self.swiglu = cfg.activation == "swiglu"
        self.up = _param(rngs, (d, f), TO_MLP, std, pd)
        if self.swiglu:
            self.gate = _param(rngs, (d, f), TO_MLP, std, pd)
        self.down = _param(rngs, (f, d), FROM_MLP, std / math.sqrt(2 * cfg.layers), pd)
        self.collective_matmul = cfg.collective_matmul

    def __call__(self, x: jax.Array) -> jax.Array:
        wide = (self.up, self.gate) if self.swiglu else (self.up,)
        hs = column_matmul(_matmuls, x, _weights(x, *wide), STREAM, (TO_MLP,) * len(wide),
                           (WIDE,) * len(wide), self.collective_matmul)
        hs = [checkpoint_name(h, MLP_IN) for h in hs]
        h = recomputed(_swiglu)(hs[1], hs[0]) if self.swiglu else recomputed(jax.nn.gelu)(hs[0])
        h = constrain(h, WIDE)
        return checkpoint_name(row_matmul(jnp.matmul, h, _weights(h, self.down), WIDE,
                                          (FROM_MLP,), STREAM, self.collective_matmul),
                               MLP_OUT)


class Block(nnx.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.param_dtype, recompute=True)
        self.attn = Attention(cfg, rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.param_dtype, recompute=True)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.attn_norm(x))
        x = constrain(x, ("batch", "seq", "act_embed"))
        x = x + self.mlp(self.mlp_norm(x))
        return constrain(x, ("batch", "seq", "act_embed"))


def _pin_layer_params(layer_state: nnx.State) -> nnx.State:
    """Constrain one layer's sliced params to their own logical sharding.

    Inside the scan body GSPMD no longer sees the stacked params' sharding; pinning the slice
    (and, by transposition, its gradient) lets the backward pass reduce-scatter each layer's
    gradient into its shards instead of all-reducing it whole. The sliced Variables still list
    the stacked ``layers`` axis first, hence ``[1:]``.
    """

    def pin(v: nnx.Variable) -> nnx.Variable:
        names, _ = names_of(v)
        return v.replace(constrain_param(v[...], names[1:])) if names else v

    return jax.tree.map(pin, layer_state, is_leaf=lambda x: isinstance(x, nnx.Variable))


class GPT(nnx.Module):
    """Token embedding → stacked blocks → RMSNorm → (tied) output head; returns logits."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        pd = cfg.param_dtype
        self.embed = _param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"),
                            cfg.init_std, pd)

        @nnx.split_rngs(splits=cfg.layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_blocks(rngs: nnx.Rngs) -> Block:
            return Block(cfg, rngs)

        self.blocks = make_blocks(rngs)
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, pd)
        if not cfg.tie_embeddings:
            self.unembed = _param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"),
                                  cfg.init_std, pd)

    def _run_blocks(self, x: jax.Array) -> jax.Array:
        graphdef, stacked = nnx.split(self.blocks)

        def body(h: jax.Array, layer_state) -> tuple[jax.Array, None]:
            return nnx.merge(graphdef, _pin_layer_params(layer_state))(h), None

        body = checkpointed(body, self.cfg.remat, scanned=self.cfg.scan_layers,
                            prevent_cse=not self.cfg.scan_layers)
        if self.cfg.scan_layers:
            return scan_layers(body, x, stacked)
        for i in range(self.cfg.layers):
            x, _ = body(x, jax.tree.map(lambda a, i=i: a[i], stacked))
        return x

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        """Token ids → the first block's input. The lookup's gradient is scattered into the
        table's own shards (:mod:`jaxmp.models.lookup`): no table-sized gradient per device
        and an all-to-all of the stream's gradient instead of the table's reduce-scatter."""
        dt = jnp.dtype(self.cfg.compute_dtype)
        x = sharded_lookup(self.embed[...], tokens, names_of(self.embed)[0], dt)
        # The lookup over the whole sequence (Megatron's vocab-parallel embedding), then split
        # as the residual stream is: under sequence parallelism the backward gathers the
        # stream's gradient before scattering it into the table, instead of shuffling token
        # ids and rows between devices (a collective a pipeline's first stage alone would
        # reach). Without it the two constraints are the same.
        x = constrain(x, ("batch", None, "act_embed"))
        return constrain(x, ("batch", "seq", "act_embed"))

    def logits(self, x: jax.Array) -> jax.Array:
        """The last block's output → logits (the pipeline's last stage runs this)."""
        x = self.final_norm(x)
        head = self.embed[...].T if self.cfg.tie_embeddings else self.unembed[...]
        # Used as an activation is (the vocabulary over tensor, as stored): the transposed
        # constraint keeps the weight gradient on that slice. Without it, under sequence
        # parallelism with the optimizer state over data (a (tensor, data) cut of the
        # vocabulary), the partitioner gathered the logits' gradient and reduced the whole
        # vocabulary's gradient over data: +10 % bytes (docs/benchmarks.md).
        head = constrain(head.astype(x.dtype), ("act_embed", "act_vocab"))
        # Under sequence parallelism the weight gradient is made before the layers' backward
        # (weight_grad_first); elsewhere XLA runs it at once anyway, and the barrier would
        # only cost the data reduction of its partial sums a reduce-scatter (test_master).
        sp = splits(x.shape, ("batch", "seq", "act_embed"), 1)
        logits = (weight_grad_first if sp else jnp.matmul)(x, head)
        return constrain(logits, ("batch", "seq", "act_vocab"))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return self.logits(self._run_blocks(self.embed_tokens(tokens)))


def lm_loss(model: nnx.Module, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict]:
    """Next-token cross entropy in float32, averaged over unmasked target tokens.

    Returns ``(loss, {"weight": tokens})`` so gradient accumulation can weight microbatches by
    their token counts and stay equal to the full-batch step when masks differ.
    """
    return next_token_loss(model(batch["inputs"]), batch)


def next_token_loss(logits: jax.Array, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict]:
    """:func:`lm_loss` from logits already computed (what a pipeline's last stage has).

    The target's logit is picked with a one-hot sum rather than a gather: with the vocabulary
    split over ``tensor`` that is a local product and one all-reduce (Megatron's vocab-parallel
    cross entropy), and XLA's partitioner handles it inside a pipeline stage, where the gather
    trips it.
    """
    logits = logits.astype(jnp.float32)
    targets = batch["targets"]
    logz = jax.nn.logsumexp(logits, axis=-1)
    hot = jax.nn.one_hot(targets, logits.shape[-1], dtype=logits.dtype)
    picked = jnp.sum(logits * hot, axis=-1)
    nll = logz - picked
    mask = batch.get("mask")
    mask = jnp.ones_like(nll) if mask is None else mask.astype(jnp.float32)
    weight = jnp.sum(mask)
    return jnp.sum(nll * mask) / jnp.maximum(weight, 1.0), {"weight": weight}
