"""KV-cached decoding equals the full forward pass; `jaxmp sample` on any device count."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxmp
from jaxmp import checkpoint
from jaxmp.config import config_to_toml
from jaxmp.models import GPT, GPTConfig
from jaxmp.models.decode import forward_cached, generate, init_cache
from jaxmp.recipes.gpt_config import load_config
from jaxmp.recipes.sample import Sampler

# GQA, SwiGLU, untied head, and a larger init so the logits are far from uniform.
CFG = GPTConfig(vocab_size=256, layers=2, d_model=64, heads=8, kv_heads=2, head_dim=8,
                mlp_dim=128, activation="swiglu", tie_embeddings=False, init_std=0.3)


@pytest.fixture(scope="module")
def model() -> GPT:
    return GPT(CFG, rngs=nnx.Rngs(0))


def test_greedy_equals_argmax_of_the_full_forward_pass(model):
    prompt = jnp.asarray(np.random.default_rng(0).integers(0, 256, (3, 7)), jnp.int32)
    out = generate(model, prompt, jax.random.key(0), 24, temperature=0)
    assert out.shape == (3, 24) and out.dtype == jnp.int32
    full = model(jnp.concatenate([prompt, out], axis=1))  # one causal pass over everything
    np.testing.assert_array_equal(np.argmax(full[:, 6:-1], axis=-1), out)
    assert len(np.unique(np.asarray(out))) > 5  # not a degenerate constant stream
    again = generate(model, prompt, jax.random.key(123), 24, temperature=0)
    np.testing.assert_array_equal(out, again)  # greedy ignores the seed


def test_cached_logits_equal_full_logits(model):
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 256, (2, 12)), jnp.int32)
    full = model(tokens)
    cache = init_cache(model, 2, 16)
    head, cache = forward_cached(model, tokens[:, :8], cache, jnp.int32(0))  # prefill
    np.testing.assert_allclose(head, full[:, :8], atol=1e-5, rtol=0)
    for t in range(8, 12):  # one token at a time
        step, cache = forward_cached(model, tokens[:, t:t + 1], cache, jnp.int32(t))
        np.testing.assert_allclose(step[:, 0], full[:, t], atol=1e-5, rtol=0)


def test_sampling_respects_seed_top_k_and_vocab_limit(model):
    prompt = jnp.zeros((4, 3), jnp.int32)
    a = generate(model, prompt, jax.random.key(0), 16, temperature=1.0)
    b = generate(model, prompt, jax.random.key(0), 16, temperature=1.0)
    c = generate(model, prompt, jax.random.key(1), 16, temperature=1.0)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    limited = generate(model, prompt, jax.random.key(2), 32, temperature=5.0, vocab_limit=10)
    assert int(limited.max()) < 10
    top1 = generate(model, prompt, jax.random.key(3), 16, temperature=1.0, top_k=1)
    np.testing.assert_array_equal(top1, generate(model, prompt, jax.random.key(0), 16,
                                                 temperature=0))


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory, model):
    """A run directory whose checkpoint was saved sharded over 8 devices (fsdp 4 x tensor 2)."""
    run = tmp_path_factory.mktemp("run")
    mesh = jaxmp.make_mesh({"fsdp": 4, "tensor": 2})
    state = nnx.state(model)
    sharded = jax.device_put(state, jaxmp.rules.shardings_for(state, mesh))
    config = load_config(None, ["model.layers=2", "model.d_model=64", "model.heads=8",
                                "model.kv_heads=2", "model.head_dim=8", "model.mlp_dim=128",
                                "model.activation=swiglu", "model.tie_embeddings=false",
                                "model.init_std=0.3", "model.vocab_size=256"])
    checkpoint.save(run / "checkpoints", 5, {"params": sharded}, config_toml=config_to_toml(config))
    return run


@pytest.mark.parametrize("n_devices", [1, 8])
def test_sampler_restores_on_any_device_count(saved_run, model, n_devices):
    mesh = jaxmp.make_mesh({"fsdp": -1}, devices=jax.devices()[:n_devices])
    sampler = Sampler.load(saved_run, mesh=mesh)
    assert sampler.step == 5 and sampler.model.embed[...].sharding.mesh.size == n_devices
    texts = sampler.sample("def ", tokens=12, temperature=0, num_samples=2)
    expected = generate(model, jnp.asarray([list(b"def ")] * 2), jax.random.key(0), 12,
                        temperature=0)
    assert texts[0] == texts[1] == "def " + sampler.text(np.asarray(expected[0]).tolist())


def test_sample_bad_inputs_are_one_clear_line(saved_run, tmp_path, capsys):
    from jaxmp.cli import main

    cases = [([str(tmp_path)], "no complete checkpoint"),
             ([str(saved_run), "--step", "3"], "no checkpoint for step 3"),
             ([str(saved_run), "--top-k", "0"], "--top-k"),
             ([str(saved_run), "--tokens", "0"], "--tokens"),
             ([str(saved_run), "--temperature", "-1"], "--temperature")]
    for args, needle in cases:
        capsys.readouterr()
        assert main(["sample", *args]) == 2, args
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and needle in err, err


def test_relative_paths_restore(saved_run, monkeypatch):
    """Orbax refuses relative paths; `jaxmp sample runs/x` (and resuming `--run-dir runs/x`)
    must not read a good checkpoint as damaged."""
    monkeypatch.chdir(saved_run.parent)
    params = checkpoint.restore(saved_run.name)
    assert params["embed"].shape == (256, 64)
    assert Sampler.load(saved_run.name).step == 5
    assert (saved_run / "checkpoints" / "5").is_dir()  # not set aside as damaged


def test_decoding_a_model_trained_with_cudnn_attention(model):
    """A model built for cuDNN's flash attention (a GPU run's) still samples on the CPU:
    decoding attends over the KV cache with XLA's kernel, so its tokens are those of the same
    parameters built for XLA."""
    import dataclasses

    graphdef, _ = nnx.split(GPT(dataclasses.replace(CFG, attention="cudnn"),
                                rngs=nnx.Rngs(0)))
    assert "cudnn" in str(graphdef)
    flash = nnx.merge(graphdef, nnx.state(model))
    prompt = jnp.asarray(np.random.default_rng(2).integers(0, 256, (2, 5)), jnp.int32)
    np.testing.assert_array_equal(generate(flash, prompt, jax.random.key(0), 12, temperature=0),
                                  generate(model, prompt, jax.random.key(0), 12, temperature=0))
