"""The GPT's options: scan vs unrolled, remat policies, GQA, SwiGLU, untied head, bf16."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxmp
from jaxmp import rules
from jaxmp.models import GPT, lm_loss
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
