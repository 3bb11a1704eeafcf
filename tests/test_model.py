"""The GPT's options: scan vs unrolled, remat policies, GQA, SwiGLU, untied head, bf16."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.ad_checkpoint import print_saved_residuals

import jaxmp
from jaxmp import rules
from jaxmp.models import GPT, lm_loss
from jaxmp.models.vjp import weight_grad_first
from helpers import TINY, lm_batch


def _loss_and_grads(cfg, mesh=None):
    model = GPT(cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    batch = {k: jnp.asarray(v) for k, v in lm_batch().items()}

    def f(p):
        return lm_loss(nnx.merge(graphdef, p), batch)[0]

    if mesh is None:
        return jax.jit(jax.value_and_grad(f))(params)
    shardings = rules.shardings_for(params, mesh)

    def g(p):
        with rules.activation_sharding(mesh):
            return jax.value_and_grad(f)(p)

    return jax.jit(g)(jax.device_put(params, shardings))


def _assert_close(a, b, rtol=1e-5):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        y = np.asarray(y)
        np.testing.assert_allclose(np.asarray(x), y, rtol=rtol, atol=rtol * np.abs(y).max())


def test_initial_loss_is_uniform():
    loss, _ = _loss_and_grads(TINY)
    assert abs(float(loss) - np.log(256)) < 0.1


@pytest.mark.parametrize("change", [dict(scan_layers=False), dict(remat="full"),
                                    dict(remat="save_dots"),
                                    dict(scan_layers=False, remat="save_dots")],
                         ids=["unrolled", "remat-full", "remat-save_dots", "unrolled-save_dots"])
def test_execution_modes_compute_the_same(change):
    ref = _loss_and_grads(TINY)
    _assert_close(_loss_and_grads(dataclasses.replace(TINY, **change)), ref)


@pytest.mark.parametrize("change", [dict(kv_heads=2), dict(activation="swiglu"),
                                    dict(tie_embeddings=False)], ids=["gqa", "swiglu", "untied"])
def test_variants_shard_exactly(change):
    cfg = dataclasses.replace(TINY, **change)
    mesh = jaxmp.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    _assert_close(_loss_and_grads(cfg, mesh), _loss_and_grads(cfg))


def test_param_count_matches_model():
    for change in [{}, dict(kv_heads=2), dict(activation="swiglu"), dict(tie_embeddings=False)]:
        cfg = dataclasses.replace(TINY, **change)
        model = nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0)))
        n = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
        assert n == cfg.n_params, change


def test_every_param_names_its_axes():
    model = nnx.eval_shape(lambda: GPT(TINY, rngs=nnx.Rngs(0)))
    names = rules.logical_names(nnx.state(model, nnx.Param))
    leaves = jax.tree.leaves(names, is_leaf=lambda x: isinstance(x, tuple) or x is None)
    assert leaves and all(isinstance(n, tuple) and all(n) for n in leaves)
    assert all(n[0] == "layers" for n in jax.tree.leaves(
        names["blocks"], is_leaf=lambda x: isinstance(x, tuple)))


def test_bf16_compute_keeps_float32_params():
    cfg = dataclasses.replace(TINY, compute_dtype="bfloat16")
    loss, grads = _loss_and_grads(cfg)
    assert np.isfinite(float(loss)) and abs(float(loss) - np.log(256)) < 0.2
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))


# ------------------------------------------------------------------ attention: XLA or cuDNN

@pytest.mark.parametrize("setting, platform, dtype, head_dim, expected", [
    ("auto", "cuda", "bfloat16", 128, "cudnn"),
    ("auto", "cuda", "float16", 64, "cudnn"),
    ("auto", "cuda", "float32", 128, "xla"),    # cuDNN's flash attention is 16-bit only
    ("auto", "cuda", "bfloat16", 96 + 4, "xla"),  # not a multiple of 8
    ("auto", "cuda", "bfloat16", 256, "xla"),   # above the portable limit
    ("auto", "cpu", "bfloat16", 64, "xla"),
    ("auto", "rocm", "bfloat16", 64, "xla"),
    ("xla", "cuda", "bfloat16", 64, "xla"),
    ("cudnn", "cuda", "bfloat16", 64, "cudnn"),
])
def test_attention_choice(setting, platform, dtype, head_dim, expected):
    from jaxmp.models.attention import choose_attention

    choice = choose_attention(setting, platform, dtype, head_dim)
    assert choice.implementation == expected
    assert str(choice).startswith(f"attention {expected} (")


def test_cudnn_where_it_cannot_run_is_bad_input():
    from jaxmp.errors import ConfigError
    from jaxmp.models.attention import choose_attention
    from jaxmp.recipes.gpt import gpt_config
    from jaxmp.recipes.gpt_config import load_config

    with pytest.raises(ConfigError, match=r"model.attention: 'cudnn' cannot run here: no cuDNN "
                                          r"on the cpu backend"):
        gpt_config(load_config(None, ["model.attention=cudnn", "model.compute_dtype=bfloat16"]))
    with pytest.raises(ConfigError, match="model.attention"):
        choose_attention("flash", "cuda", "bfloat16", 64)
    with pytest.raises(ConfigError, match="model.attention"):
        load_config(None, ["model.attention=flash"])


def test_device_platform_tells_cuda_from_rocm():
    from types import SimpleNamespace as Dev

    from jaxmp.models.attention import device_platform

    assert device_platform(Dev(platform="gpu", device_kind="NVIDIA H100 80GB HBM3")) == "cuda"
    assert device_platform(Dev(platform="gpu", device_kind="AMD Instinct MI300X")) == "rocm"
    assert device_platform(jax.devices()[0]) == "cpu"


def test_recipe_resolves_attention_for_where_the_model_runs():
    """The recipe asks the devices: `auto` is XLA here, cuDNN for CUDA devices in bf16; the
    cuDNN model traces on the CPU (the cost model traces it so) with the fused primitives."""
    from jaxmp.recipes.gpt import gpt_config
    from jaxmp.recipes.gpt_config import load_config

    cfg = load_config(None, ["model.compute_dtype=bfloat16", "model.vocab_size=256",
                             "model.layers=1"])
    assert gpt_config(cfg).attention == "xla"
    cudnn = gpt_config(cfg, platform="cuda")
    assert cudnn.attention == "cudnn"
    assert gpt_config(load_config(None, ["model.vocab_size=256"]), "cuda").attention == "xla"
    model = GPT(cudnn, rngs=nnx.Rngs(0))
    tokens = jax.ShapeDtypeStruct((2, 16), jnp.int32)
    jaxpr = str(jax.make_jaxpr(lambda t: model(t))(tokens))
    assert "dot_product_attention_fwd" in jaxpr


def test_scanned_layers_save_no_copy_of_their_weights(capsys):
    """remat none, scanned, 16-bit params: the backward re-slices the stacked weights (the
    argument) instead of saving each layer's pinned slice into a stacked copy
    (jaxmp.remat.keeps_all_but_constraints)."""
    cfg = dataclasses.replace(TINY, param_dtype=jnp.bfloat16, compute_dtype=jnp.bfloat16)
    assert cfg.remat == "none" and cfg.scan_layers
    model = GPT(cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    batch = {k: jnp.asarray(v) for k, v in lm_batch().items()}
    stacked = {f"bf16[{','.join(map(str, x.shape))}]"
               for x in jax.tree.leaves(nnx.state(model.blocks))}
    mesh = jaxmp.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    params = jax.device_put(params, rules.shardings_for(params, mesh))
    with rules.activation_sharding(mesh):  # each layer's slice pinned to its sharding
        print_saved_residuals(lambda p: lm_loss(nnx.merge(graphdef, p), batch)[0], params)
    saved = capsys.readouterr().out.splitlines()  # "bf16[2,64,256] from the argument p..."
    assert any(line.split()[0] in stacked for line in saved)  # the weights, as arguments
    copies = [line for line in saved if line.split()[0] in stacked and "argument" not in line]
    assert not copies, copies


def _saved_shapes(fn, params, capsys) -> list[tuple[int, ...]]:
    """The shapes of what ``fn``'s backward pass keeps (jax's print_saved_residuals lines,
    "f32[2,8,16,64] output of ..."), the arguments left out."""
    capsys.readouterr()
    print_saved_residuals(fn, params)
    lines = [x for x in capsys.readouterr().out.splitlines() if "argument" not in x]
    return [tuple(int(d) for d in x.split()[0].split("[")[1].rstrip("]").split(",") if d)
            for x in lines]


def test_save_dots_except_mlp_in_shards_exactly_and_keeps_the_projections(capsys):
    """The name-based policy changes no loss or gradient (float32, data2×fsdp2×tensor2 against
    one device without remat), and the blocks keep what it names and the backward needs — q,
    k, v, the attention's output — besides the block's input, never the MLP's mlp_dim-wide
    inputs (save_dots keeps both)."""
    base = dataclasses.replace(TINY, activation="swiglu")
    cfg = dataclasses.replace(base, remat="save_dots_except_mlp_in")
    mesh = jaxmp.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    _assert_close(_loss_and_grads(cfg, mesh), _loss_and_grads(base))
    batch = {k: jnp.asarray(v) for k, v in lm_batch().items()}
    rows, seq = batch["inputs"].shape

    def layer_residuals(c):
        graphdef, params = nnx.split(GPT(c, rngs=nnx.Rngs(0)))
        saved = _saved_shapes(lambda p: lm_loss(nnx.merge(graphdef, p), batch)[0], params,
                              capsys)
        return sorted(a[1:] for a in saved if a[:1] == (c.layers,) and
                      a[1:3] == (rows, seq))  # stacked per-layer activations

    qkv = [(rows, seq, TINY.heads, TINY.head_dim)] * 3
    wide = [(rows, seq, TINY.mlp_dim)] * 2
    kept = layer_residuals(cfg)
    assert kept == sorted(qkv + [(rows, seq, TINY.d_model)] * 2), kept
    assert sorted(layer_residuals(dataclasses.replace(base, remat="save_dots"))) == sorted(
        kept + wide)


def test_selective_recomputes_only_the_attention_core(capsys):
    """``"selective"`` (Megatron's selective recomputation): the same loss and gradients as no
    remat (float32, data2×fsdp2×tensor2 against one device, GQA), and the blocks keep no S × S
    array of XLA's attention (no remat keeps two float32 ones a layer, the softmax's row
    statistics and the mask), only the core's inputs in their place."""
    base = dataclasses.replace(TINY, kv_heads=2)
    cfg = dataclasses.replace(base, remat="selective")
    mesh = jaxmp.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    _assert_close(_loss_and_grads(cfg, mesh), _loss_and_grads(base))
    batch = {k: jnp.asarray(v) for k, v in lm_batch().items()}
    seq = batch["inputs"].shape[1]

    def stacked(c):
        graphdef, params = nnx.split(GPT(c, rngs=nnx.Rngs(0)))
        saved = _saved_shapes(lambda p: lm_loss(nnx.merge(graphdef, p), batch)[0], params,
                              capsys)
        return sorted(a for a in saved if a[:1] == (c.layers,))

    kept, everything = stacked(cfg), stacked(base)
    scores = [a for a in everything if a[-2:] == (seq, seq)]
    assert len(scores) >= 2 and not [a for a in kept if a[-2:] == (seq, seq)]
    size = lambda shapes: sum(np.prod(a) for a in shapes)  # noqa: E731
    assert size(everything) - size(kept) >= size(scores) - size([a for a in kept
                                                                   if a not in everything])


def test_research_layers_without_names_recompute_everything_under_a_name_policy(capsys):
    """Stock nnx.Linear names nothing: save_dots_except_mlp_in saves what "full" saves (the
    inputs alone) and computes the same gradients."""
    mlp = nnx.Sequential(nnx.Linear(8, 32, rngs=nnx.Rngs(0)), jax.nn.gelu,
                         nnx.Linear(32, 8, rngs=nnx.Rngs(1)))
    graphdef, params = nnx.split(mlp)
    x = jnp.ones((4, 8))

    def loss(remat):
        run = jaxmp.remat.checkpointed(lambda p, x: nnx.merge(graphdef, p)(x), remat)
        return lambda p: jnp.sum(run(p, x) ** 2)

    kept = {r: _saved_shapes(loss(r), params, capsys)
            for r in ("save_dots_except_mlp_in", "full", "save_dots")}
    assert kept["save_dots_except_mlp_in"] == kept["full"] != kept["save_dots"]
    _assert_close(jax.grad(loss("save_dots_except_mlp_in"))(params), jax.grad(loss("none"))(params))


def test_head_weight_gradient_is_tied_to_its_input_gradient():
    """The output head's matmul (jaxmp.models.vjp.weight_grad_first) has the plain matmul's
    value and gradients, and its backward pass hands both out of one optimization barrier:
    the GPU scheduler cannot postpone the weight gradient past the layers' backward
    (docs/planner.md §7, Stop 29)."""
    x = jax.random.normal(jax.random.key(0), (2, 8, 16))
    w = jax.random.normal(jax.random.key(1), (16, 32))
    loss = lambda f: lambda x, w: jnp.sum(jnp.tanh(f(x, w)))  # noqa: E731
    got = jax.grad(loss(weight_grad_first), argnums=(0, 1))(x, w)
    want = jax.grad(loss(jnp.matmul), argnums=(0, 1))(x, w)
    np.testing.assert_allclose(weight_grad_first(x, w), x @ w, rtol=1e-6)
    for g, h in zip(got, want):
        np.testing.assert_allclose(g, h, rtol=1e-6)
    backward = str(jax.make_jaxpr(jax.grad(loss(weight_grad_first), argnums=(0, 1)))(x, w))
    assert "optimization_barrier" in backward
