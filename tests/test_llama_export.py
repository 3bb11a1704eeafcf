"""`jaxmp ckpt export --format llama`: HF Llama names and layouts, checked by re-implementing
Llama's forward pass in plain numpy from the exported file alone."""
from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from jaxmp import checkpoint
from jaxmp.cli import main
from jaxmp.config import config_to_toml
from jaxmp.models import GPT
from jaxmp.recipes.gpt import gpt_config
from jaxmp.recipes.gpt_config import load_config

LLAMA = ["model.layers=2", "model.d_model=64", "model.heads=4", "model.kv_heads=2",
         "model.head_dim=16", "model.mlp_dim=96", "model.activation=swiglu",
         "model.tie_embeddings=false", "model.vocab_size=128", "model.init_std=0.2",
         "model.norm_eps=1e-6", "data.seq_len=32", "data.source=synthetic"]


def _save(root: Path, overrides: list[str]) -> tuple[GPT, Path]:
    config = load_config(None, overrides)
    model = GPT(gpt_config(config), rngs=nnx.Rngs(3))
    # RMSNorm scales start at 1: make them matter so a misplaced norm weight is caught
    for norm in (model.blocks.attn_norm, model.blocks.mlp_norm, model.final_norm):
        norm.scale[...] = 1 + 0.5 * np.random.default_rng(0).standard_normal(norm.scale.shape)
    checkpoint.save(root / "checkpoints", 9, {"params": nnx.state(model)},
                    config_toml=config_to_toml(config))
    return model, root


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    model, run = _save(tmp_path_factory.mktemp("run"), LLAMA)
    out = run / "hf"
    assert main(["ckpt", "export", str(run), "--format", "llama", "--out", str(out)]) == 0
    return model, load_file(out / "model.safetensors"), json.loads((out / "config.json").read_text())


def test_names_shapes_and_config(exported):
    _, weights, cfg = exported
    expected = {"model.embed_tokens.weight": (128, 64), "model.norm.weight": (64,),
                "lm_head.weight": (128, 64)}
    for i in range(2):
        p = f"model.layers.{i}."
        expected |= {p + "input_layernorm.weight": (64,), p + "post_attention_layernorm.weight": (64,),
                     p + "self_attn.q_proj.weight": (64, 64), p + "self_attn.k_proj.weight": (32, 64),
                     p + "self_attn.v_proj.weight": (32, 64), p + "self_attn.o_proj.weight": (64, 64),
                     p + "mlp.gate_proj.weight": (96, 64), p + "mlp.up_proj.weight": (96, 64),
                     p + "mlp.down_proj.weight": (64, 96)}
    assert {k: tuple(v.shape) for k, v in weights.items()} == expected
    assert all(v.dtype == np.float32 for v in weights.values())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"],
            cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"],
            cfg["vocab_size"], cfg["rms_norm_eps"], cfg["max_position_embeddings"],
            cfg["tie_word_embeddings"], cfg["hidden_act"]) == (64, 96, 2, 4, 2, 16, 128, 1e-6,
                                                                32, False, "silu")


def llama_logits(w: dict[str, np.ndarray], cfg: dict, ids: np.ndarray) -> np.ndarray:
    """HF LlamaForCausalLM's forward pass (eager attention), in float64 numpy."""
    w = {k: v.astype(np.float64) for k, v in w.items()}
    n, hd = len(ids), cfg["head_dim"]
    heads, kv, eps = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["rms_norm_eps"]

    def rms(x, weight):
        return weight * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))

    def rotate_half(x):
        return np.concatenate([-x[..., hd // 2:], x[..., :hd // 2]], axis=-1)

    inv_freq = 1.0 / cfg["rope_theta"] ** (np.arange(0, hd, 2) / hd)
    emb = np.concatenate([np.outer(np.arange(n), inv_freq)] * 2, axis=-1)[:, None, :]
    cos, sin = np.cos(emb), np.sin(emb)
    causal = np.tril(np.ones((n, n), bool))
    x = w["model.embed_tokens.weight"][ids]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms(x, w[p + "input_layernorm.weight"])
        q = (h @ w[p + "self_attn.q_proj.weight"].T).reshape(n, heads, hd)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).reshape(n, kv, hd)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(n, kv, hd)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = np.repeat(k, heads // kv, axis=1), np.repeat(v, heads // kv, axis=1)  # repeat_kv
        scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd)
        scores = np.where(causal, scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        attn = np.einsum("hts,shd->thd", probs, v).reshape(n, heads * hd)
        x = x + attn @ w[p + "self_attn.o_proj.weight"].T
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        gate = h @ w[p + "mlp.gate_proj.weight"].T
        x = x + ((gate / (1 + np.exp(-gate))) * (h @ w[p + "mlp.up_proj.weight"].T)) \
            @ w[p + "mlp.down_proj.weight"].T
    return rms(x, w["model.norm.weight"]) @ w["lm_head.weight"].T


def test_numpy_llama_forward_matches_jaxmp(exported):
    model, weights, cfg = exported
    ids = np.random.default_rng(1).integers(0, 128, 24)
    ours = np.asarray(model(jnp.asarray(ids[None], jnp.int32))[0])
    theirs = llama_logits(weights, cfg, ids)
    assert np.abs(ours).max() > 1  # logits far from zero: the comparison means something
    np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("change,field", [("model.activation=gelu", "model.activation")])
def test_non_llama_config_names_the_field(tmp_path, capsys, change, field):
    _, run = _save(tmp_path, LLAMA + [change])
    rc = main(["ckpt", "export", str(run), "--format", "llama", "--out", str(tmp_path / "hf")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and field in err and "Llama" in err, err
    assert not (tmp_path / "hf" / "model.safetensors").exists()


def test_tied_embeddings_export_as_tie_word_embeddings(tmp_path):
    """A tied head is Llama's ``tie_word_embeddings``: no lm_head tensor, the same logits."""
    model, run = _save(tmp_path, LLAMA + ["model.tie_embeddings=true"])
    out = run / "hf"
    assert main(["ckpt", "export", str(run), "--format", "llama", "--out", str(out)]) == 0
    weights, cfg = load_file(out / "model.safetensors"), json.loads((out / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is True and "lm_head.weight" not in weights
    ids = np.random.default_rng(2).integers(0, 128, 16)
    theirs = llama_logits({**weights, "lm_head.weight": weights["model.embed_tokens.weight"]},
                          cfg, ids)
    ours = np.asarray(model(jnp.asarray(ids[None], jnp.int32))[0])
    np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=0)


def test_a_pipelined_checkpoint_exports_like_the_plain_one(exported, tmp_path):
    """A run trained with stages stores its layer stack padded ``[P, V·Lmax, ...]``: exported
    in the plain layout, the same tensors as the plain checkpoint's (it crashed before stop
    30: the stage count was read as the layer count)."""
    from jaxmp.pipeline.chunk import to_stages
    from jaxmp.pipeline.stages import split_layers
    from jaxmp.recipes.gpt import gpt_pipeline

    model, weights, _ = exported
    config = load_config(None, LLAMA)
    staged = to_stages(nnx.state(model), gpt_pipeline(config),
                       split_layers([1.0] * 4, 2, 1, "layers"))
    checkpoint.save(tmp_path / "checkpoints", 9, {"params": staged},
                    config_toml=config_to_toml(config))
    assert main(["ckpt", "export", str(tmp_path), "--format", "llama", "--out",
                 str(tmp_path / "hf")]) == 0
    got = load_file(tmp_path / "hf" / "model.safetensors")
    assert set(got) == set(weights)
    for k, v in weights.items():
        np.testing.assert_array_equal(got[k], v)
