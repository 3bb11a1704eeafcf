"""jaxmp.cost: FLOPs counted from jaxprs, per-layer costs of NNX models, checked against
Megatron's formula and XLA's cost_analysis of each layer compiled alone."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxmp.cost import model_costs, xla_layer_check
from jaxmp.models import GPT, GPTConfig, lm_loss
from jaxmp.cost import flops as F
from jaxmp.cost.splits import var_names
from jaxmp.plan.divisor import saved_divisor

# Big enough that matmuls dominate (as in any real model), small enough to trace in a second.
MID = GPTConfig(vocab_size=512, layers=3, d_model=256, heads=4, kv_heads=4, head_dim=64,
                mlp_dim=1024)
B, S = 8, 64


def _batch(b: int = B, s: int = S) -> dict:
    return {"inputs": jax.ShapeDtypeStruct((b, s), jnp.int32),
            "targets": jax.ShapeDtypeStruct((b, s), jnp.int32)}


@pytest.fixture(scope="module")
def mid_cost():
    return model_costs(lambda r: GPT(MID, rngs=r), _batch(), lm_loss)


# ---------------------------------------------------------------- the FLOP counter

def _count(fn, *args) -> F.Counts:
    return F.count_jaxpr(jax.make_jaxpr(fn)(*args)).total


def test_dot_general_is_exact():
    a, b = jnp.ones((3, 5, 7)), jnp.ones((3, 7, 11))
    assert _count(lambda x, y: jnp.einsum("bij,bjk->bik", x, y), a, b).flops == 2 * 3 * 5 * 7 * 11


def test_conv_is_exact():
    x, w = jnp.ones((2, 3, 16, 16)), jnp.ones((8, 3, 3, 3))
    out = jax.lax.conv_general_dilated(x, w, (1, 1), "SAME")
    c = _count(lambda x, w: jax.lax.conv_general_dilated(x, w, (1, 1), "SAME"), x, w)
    assert c.flops == 2 * out.size * 3 * 3 * 3


def test_elementwise_reductions_transcendentals_and_free_ops():
    x = jnp.ones((4, 8))
    c = _count(lambda x: jnp.sum(jnp.exp(x) * 2.0 + x.T.T), x)
    assert c.transcendentals == 32  # exp
    assert c.flops == 32 + 32 + 32  # mul, add, reduce over the input; transposes are free


def test_scan_multiplies_by_its_length_and_cond_takes_the_larger_branch():
    w = jnp.ones((5, 6, 6))

    def body(h, wi):
        return h @ wi, None

    c = _count(lambda h, w: jax.lax.scan(body, h, w)[0], jnp.ones((2, 6)), w)
    assert c.flops == 5 * 2 * 2 * 6 * 6
    big = _count(lambda p, x: jax.lax.cond(p, lambda x: x @ x, lambda x: x + 1, x),
                 True, jnp.ones((4, 4)))
    assert big.flops == 2 * 4 * 4 * 4


def test_backward_equations_are_marked():
    f = lambda w, x: jnp.sum(jnp.tanh(x @ w))  # noqa: E731
    jaxpr = jax.make_jaxpr(jax.grad(f))(jnp.ones((4, 4)), jnp.ones((2, 4)))
    kinds = {F.is_backward(e.name_stack) for e in F.iter_eqns(jaxpr)}
    assert kinds == {True, False}


# ---------------------------------------------------------------- per-layer costs

def test_gpt_layers_in_order_with_tied_embedding(mid_cost):
    names = [lay.name for lay in mid_cost.layers]
    assert names == ["pre", "blocks/0", "blocks/1", "blocks/2", "final_norm", "post"]
    pre, post = mid_cost.layers[0], mid_cost.layers[-1]
    assert [x.path for x in pre.params] == ["embed"] == [x.path for x in post.params]
    assert mid_cost.param_count == MID.n_params  # the tied table counted once
    block = mid_cost.layers[1]
    assert block.param_count * MID.layers + pre.param_count + MID.d_model == MID.n_params
    assert block.optimizer_bytes == 2 * block.param_bytes  # Adam: two moments
    assert block.in_loop and not pre.in_loop
    assert block.boundary_bytes == block.input_bytes == B * S * MID.d_model * 4


def test_layer_flops_sum_to_the_whole_program(mid_cost):
    total_fwd = sum(lay.fwd_flops for lay in mid_cost.layers)
    total_bwd = sum(lay.bwd_flops for lay in mid_cost.layers)
    assert total_fwd == pytest.approx(mid_cost.program_fwd_flops, rel=0.01)
    assert total_bwd == pytest.approx(mid_cost.program_bwd_flops, rel=0.01)


def test_training_flops_match_megatron(mid_cost):
    """72·B·s·l·h²·(1 + s/6h) + 6·B·s·h·V (no recompute), within 3 %."""
    h, n, v = MID.d_model, MID.layers, MID.vocab_size
    megatron = 72 * B * S * n * h * h * (1 + S / (6 * h)) + 6 * B * S * h * v
    assert mid_cost.flops_per_step("none") == pytest.approx(megatron, rel=0.03)
    assert mid_cost.flops_per_step("none") == pytest.approx(
        MID.flops_per_token(S) * B * S, rel=0.03)


def test_each_layer_matches_xla_cost_analysis(mid_cost):
    rows = xla_layer_check(mid_cost)
    assert {r["layer"] for r in rows} == {"blocks", "final_norm"}
    for r in rows:
        if r["pass"] == "fwd" or r["layer"] == "blocks":
            assert r["rel_err"] < 0.05, r
        else:  # a norm alone: elementwise only, XLA fuses and duplicates some of it
            assert r["rel_err"] < 0.15, r


def test_remat_policies_trade_memory_for_recompute(mid_cost):
    block = mid_cost.layers[1]
    none, dots, dots_but_mlp, full = (block.saved[p].bytes for p in (
        "none", "save_dots", "save_dots_except_mlp_in", "full"))
    assert full < dots_but_mlp < dots < none
    assert full == block.input_bytes  # full remat keeps only the block's input
    # save_dots less the MLP's 4 x d_model input: the rest (the block's input, q, k, v, the
    # attention's output) is what save_dots_except_mlp_in keeps
    assert dots - dots_but_mlp == B * S * MID.mlp_dim * 4
    recompute = [block.recompute_flops[p] for p in ("none", "save_dots",
                                                    "save_dots_except_mlp_in", "full")]
    assert recompute[0] == 0 and 0 < recompute[1] < recompute[2] < recompute[3]
    assert block.recompute_flops["full"] <= block.fwd_flops


def test_selective_drops_the_attention_scores_and_recomputes_their_flops(mid_cost):
    """XLA attention: "selective" keeps "none"'s residuals but the S × S arrays (B × heads ×
    S × S each) and recomputes only the attention core's forward (its two batched matmuls,
    2 × 2·B·heads·S²·head_dim FLOPs, and elementwise work)."""
    block = mid_cost.layers[1]
    none, selective, dots = (block.saved[p].bytes for p in ("none", "selective", "save_dots"))
    scores = B * MID.heads * S * S * 4
    assert dots < selective and none - selective >= 2 * scores  # two float32 S x S a layer
    core = 2 * 2 * B * MID.heads * S * S * MID.head_dim
    assert core <= block.recompute_flops["selective"] < block.recompute_flops["save_dots"]
    assert block.staged["selective"].bytes < block.staged["none"].bytes


def test_fusion_and_backward_working_set(mid_cost):
    block = mid_cost.layers[1]
    # Straight-line code keeps fewer activations than a scan materialises, never more.
    assert block.fused["none"].bytes < block.saved["none"].bytes
    assert block.fused["full"].bytes == block.saved["full"].bytes
    # Recomputing the block in the backward pass needs more room than keeping it did.
    peaks = {p: block.transient[p].peak(B) for p in ("none", "full")}
    assert 0 < peaks["none"] < peaks["full"]
    assert block.transient["none"].peak(B // 2) == pytest.approx(peaks["none"] / 2, rel=0.05)
    assert block.transient["none"].peak(B, lambda shape, bdim, names=None: 2) == pytest.approx(
        peaks["none"] / 2)


def test_a_loop_body_holds_its_fused_residuals_and_the_hoisted_mask(mid_cost):
    """A scanned block's forward as the GPU's layer loop runs it (``LayerCost.forward``,
    jaxmp.plan.forward): its fused residuals live to the body's end (copied into their
    stacks there), and the causal mask and its fill value at the scores' shape, which no
    input feeds, are live from the start (XLA hoists them out of the loop; docs/planner.md §7
    "Stop 35 (Sc3)"). Grouped-query scores are told apart (jaxmp.plan.scan keeps JAX's list)."""
    from jaxmp.cost.fusion import grouped_scores

    block = mid_cost.layers[1]
    body = block.forward["none"]
    scores = (B, MID.heads, S, S)
    hoisted = [(shape, item) for shape, item, start in zip(body.shapes, body.itemsizes,
                                                           body.starts)
               if start == 0 and shape[-2:] == (S, S)]
    assert sorted(item for _, item in hoisted) == [1, 4]  # the mask and the float32 fill
    assert all(np.prod(shape) == np.prod(scores) for shape, _ in hoisted)
    peak = body.peak_of(body.sizes(), B, forward=True)
    assert peak >= block.fused["none"].bytes_at(B) + np.prod(scores) * (1 + 4)
    assert grouped_scores([(4, B, 2, S, S)], [1], S)
    assert not grouped_scores([(1, B, MID.heads, S, S)], [1], S)
    assert not grouped_scores([(B, S, MID.heads, 64)], [0], S)


def test_costs_scale_with_rows(mid_cost):
    half = model_costs(lambda r: GPT(MID, rngs=r), _batch(B // 2), lm_loss,
                       policies=("none",))
    for a, b in zip(mid_cost.layers, half.layers):
        # Linear in the rows, up to the batch-independent bits (rotary tables: ~1e-5).
        assert b.fwd_flops == pytest.approx(a.fwd_flops / 2, rel=1e-4)
        saved = a.saved["none"]
        assert saved.bytes_at(B // 2) == pytest.approx(b.saved["none"].bytes, rel=1e-6)


def test_post_layer_keeps_the_logits(mid_cost):
    post = mid_cost.layers[-1]
    assert post.saved["none"].bytes >= B * S * MID.vocab_size * 4
    assert post.fwd_flops >= 2 * B * S * MID.d_model * MID.vocab_size


class _Mixer(nnx.Module):
    def __init__(self, d: int, rngs: nnx.Rngs):
        self.w = nnx.Linear(d, d, rngs=rngs)

    def __call__(self, x):
        return jax.nn.relu(self.w(x)) + x


class _Tower(nnx.Module):
    """Not our GPT: a list of layers, a head, Linen-free plain nnx.Linear params."""

    def __init__(self, rngs: nnx.Rngs):
        self.stem = nnx.Linear(16, 32, rngs=rngs)
        self.layers = nnx.List([_Mixer(32, rngs) for _ in range(3)])
        self.head = nnx.Linear(32, 4, rngs=rngs)

    def __call__(self, x):
        x = self.stem(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_any_nnx_model():
    rows = 10
    cost = model_costs(lambda r: _Tower(r), jax.ShapeDtypeStruct((rows, 16), jnp.float32),
                       tx=optax.adamw(1e-3))
    names = [lay.name for lay in cost.layers]
    assert names == ["pre", "stem", "layers/0", "layers/1", "layers/2", "head", "post"]
    by = {lay.name: lay for lay in cost.layers}
    assert by["stem"].fwd_flops == 2 * rows * 16 * 32 + rows * 32  # matmul + bias
    # bias, relu, its derivative mask (computed in the forward pass for the backward), + x
    assert by["layers/1"].fwd_flops == 2 * rows * 32 * 32 + 4 * rows * 32
    assert by["stem"].bwd_flops >= 2 * by["stem"].fwd_flops - rows * 32 * 2
    assert by["layers/0"].param_count == 32 * 32 + 32
    # optax.adamw: two moments (and a step count)
    assert by["layers/0"].optimizer_bytes == pytest.approx(2 * by["layers/0"].param_bytes,
                                                           abs=16)
    assert sum(lay.param_count for lay in cost.layers) == 16 * 32 + 32 + 3 * (32 * 32 + 32) \
        + 32 * 4 + 4
    assert by["layers/2"].boundary_bytes == rows * 32 * 4


def test_unrolled_stack_costs_the_same():
    unrolled = dataclasses.replace(MID, scan_layers=False, layers=2)
    scanned = dataclasses.replace(MID, layers=2)
    a = model_costs(lambda r: GPT(unrolled, rngs=r), _batch(), lm_loss, policies=("none",))
    b = model_costs(lambda r: GPT(scanned, rngs=r), _batch(), lm_loss, policies=("none",))
    assert [x.name for x in a.layers] == [x.name for x in b.layers]
    for x, y in zip(a.layers, b.layers):
        assert x.fwd_flops == pytest.approx(y.fwd_flops, rel=1e-6)
        assert x.param_bytes == y.param_bytes
    assert not a.layers[1].in_loop and b.layers[1].in_loop
    assert a.flops_per_step() == pytest.approx(a.program_fwd_flops + a.program_bwd_flops,
                                               rel=0.01)


def test_saved_divisor_applies_per_array(mid_cost):
    block = mid_cost.layers[1].saved["none"]
    assert block.bytes_at(B, lambda shape, bdim, names=None: 2) == pytest.approx(block.bytes / 2)
    const, per_row = block.split()
    assert const + per_row * B == pytest.approx(block.bytes)
    assert np.isfinite(per_row) and per_row > 0


# ---------------------------------------------------------------- cuDNN flash attention

def test_fused_attention_counts_as_the_attention_it_replaces():
    """cuDNN's fused attention is one primitive: its FLOPs are those of XLA's attention
    matmuls (4·B·N·T·S·H forward, twice that backward), GQA included."""
    b, t, n, kvh, h = 2, 128, 4, 2, 32

    def attend(impl):
        def f(q, k, v):
            out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)
            return out.astype(jnp.float32).sum()
        return jax.value_and_grad(f, argnums=(0, 1, 2))

    q = jax.ShapeDtypeStruct((b, t, n, h), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((b, t, kvh, h), jnp.bfloat16)
    jaxpr = jax.make_jaxpr(attend("cudnn"))(q, kv, kv)
    kernels = [e for e in jaxpr.jaxpr.eqns if F.is_kernel(e.primitive.name)]
    assert [F.eqn_counts(e).flops for e in kernels] == [4 * b * n * t * t * h,
                                                        8 * b * n * t * t * h]
    xla = F.count_jaxpr(jax.make_jaxpr(attend("xla"))(q, kv, kv)).total.flops
    cudnn = F.count_jaxpr(jaxpr).total.flops
    assert cudnn == pytest.approx(xla, rel=0.1)  # XLA's adds its softmax's elementwise work


def test_flash_attention_saves_no_scores():
    """The cost model of a bf16 GPT at seq 512: with cuDNN's attention a block saves q, k, v,
    the output and a float32 softmax statistic per row, nothing S x S, and its backward
    working set shrinks with it; FLOPs stay those of the model."""
    cfg = GPTConfig(vocab_size=256, layers=2, d_model=128, heads=4, kv_heads=2, head_dim=32,
                    mlp_dim=256, compute_dtype="bfloat16")
    seq = 512

    def block(attention):
        cost = model_costs(lambda r: GPT(dataclasses.replace(cfg, attention=attention), rngs=r),
                           _batch(2, seq), lm_loss, policies=("none",))
        return next(lay for lay in cost.layers if lay.kind == "block")

    xla, flash = block("xla"), block("cudnn")
    square = lambda lay: [s for s in lay.saved["none"].shapes if list(s).count(seq) >= 2]  # noqa: E731
    assert square(xla) and not square(flash)
    assert (2, 4, seq) in flash.saved["none"].shapes  # the softmax statistics [B, N, T]
    for what in ("saved", "fused"):
        assert getattr(flash, what)["none"].bytes < 0.5 * getattr(xla, what)["none"].bytes
    peak = lambda lay: lay.transient["none"].peak(2)  # noqa: E731
    assert peak(flash) < 0.5 * peak(xla)
    assert flash.fwd_flops == pytest.approx(xla.fwd_flops, rel=0.05)
    # Memory traffic (jaxmp.cost.traffic): XLA's attention moves its S x S arrays through
    # HBM, forward and backward (4 bytes x B x N x T x S per float32 array); cuDNN's kernel
    # moves none of them.
    square_bytes = 4 * 2 * 4 * seq * seq
    at = lambda lay: lay.traffic["none"].attention[1] * 2 + lay.traffic["none"].attention[0]  # noqa: E731
    assert at(xla) > 4 * square_bytes
    assert at(flash) < 0.05 * at(xla)


def test_traffic_counts_fusions_and_thin_matmuls():
    """A fusion reads what it takes from a matmul once and writes what a matmul reads; a
    parameter's cast is not counted; each matmul lists its FLOPs and bytes."""
    from jaxmp.cost import traffic

    n, d, f = 64, 32, 128

    def fn(w1, w2, x):
        h = x @ w1.astype(jnp.bfloat16)                # dot: [n, f] bf16
        with jax.named_scope("attention"):
            g = jax.nn.gelu(h.astype(jnp.float32))     # one fusion: reads h, writes g (f32)
        return (g.astype(jnp.bfloat16) @ w2.astype(jnp.bfloat16)).sum()

    args = (jax.ShapeDtypeStruct((d, f), jnp.float32), jax.ShapeDtypeStruct((f, d), jnp.float32),
            jax.ShapeDtypeStruct((n, d), jnp.bfloat16))
    jaxpr = jax.make_jaxpr(fn)(*args)
    t = traffic.count(jaxpr, jaxpr.jaxpr.invars[:2])
    # gelu's fusion reads h (bf16), writes its bf16 cast for the matmul; the sum reads the
    # second matmul's output and writes a few scalars (in float32, cast back)
    assert t.attention_bytes == n * f * 2 + n * f * 2
    assert n * d * 2 < t.fused_bytes - t.attention_bytes <= n * d * 2 + 16
    assert [fl for fl, _ in t.dots] == [2 * n * d * f, 2 * n * f * d]
    assert t.dots[0][1] == n * d * 2 + d * f * 2 + n * f * 2
    lin = traffic.linear(t, traffic.count(jax.make_jaxpr(fn)(*args[:2], jax.ShapeDtypeStruct(
        (1, d), jnp.bfloat16)), jaxpr.jaxpr.invars[:2]), n)
    assert lin.fused[1] * n + lin.fused[0] == pytest.approx(t.fused_bytes)


def test_split_names_follow_the_weights_not_the_sizes():
    """A 2-D query projection as wide as the residual stream (jaxmp.cost.splits): its output
    carries the heads' name, the stream and the norm's output none, though all are 128 wide;
    the scores keep the heads' name through the reshape, and the output projection's
    contraction over the heads drops it (docs/planner.md §7 "Stop 35 (Rm3)")."""
    def block(wq, wo, x):
        h = x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True))
        q = (h @ wq).reshape(4, 64, 8, 16)
        s = jnp.einsum("bthd,bshd->bhts", q, q)
        a = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s), q).reshape(4, 64, 128)
        return x + a @ wo, h, q, s

    f32 = jnp.float32
    jaxpr = jax.make_jaxpr(block)(jax.ShapeDtypeStruct((128, 128), f32),
                                  jax.ShapeDtypeStruct((128, 128), f32),
                                  jax.ShapeDtypeStruct((4, 64, 128), f32))
    heads, emb = frozenset({"heads"}), frozenset({"embed"})
    names = var_names(jaxpr, [(emb, heads), (heads, emb), None])
    out, h, q, s = (names[v] for v in jaxpr.jaxpr.outvars)
    assert out == (frozenset(), frozenset(), emb) and h == (frozenset(),) * 3
    assert q[2] == heads and s[1] == heads
    div = saved_divisor(frozenset({128}), 8, split_names=frozenset({"heads"}))
    assert [div((4, 64, 128), 0, n) for n in (out, h)] == [1, 1]
    assert div((4, 64, 8, 16), 0, q) == div((4, 8, 64, 64), 0, s) == 8
    assert div((4, 64, 128), 0) == 8  # by size alone: the stream counted split
