"""A sharded train step equals the single-device step (float32, tight tolerance)."""
from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from flax import nnx

import jaxmp
from jaxmp.models import lm_loss
from jaxmp._util.arrays import tree_bytes as state_bytes
from jaxmp.config import OptimizerConfig
from jaxmp.train.optimizer import make_optimizer, make_schedule
from jaxmp.train.state import addressable_bytes, init_state, plan_state
from jaxmp.train.step import batch_sharding, make_grad_fn, make_train_step
from helpers import gpt_fn, lm_batch, one_device

# eps sets Adam's noise floor: with eps=1e-8 a gradient element at float32 noise level (1e-10)
# still moves its parameter by ±lr (the first Adam step is sign(g)), so summation order alone
# would flip it. 1e-4 keeps the update a smooth function of the gradient, as the test needs.
OPT = OptimizerConfig(lr=1e-3, warmup_steps=1, eps=1e-4)
MESHES = [{"data": 8}, {"fsdp": 8}, {"tensor": 8}, {"data": 2, "fsdp": 2, "tensor": 2}]
D2F2T2 = MESHES[-1]


def _run(axes: dict, devices=None, steps: int = 3, grad_accum: int = 1,
         sum_in_backward: bool = False):
    mesh = jaxmp.make_mesh(axes, devices)
    tx, sched = make_optimizer(OPT, 10), make_schedule(OPT, 10)
    layout = plan_state(gpt_fn(), tx, mesh)
    state = init_state(layout, gpt_fn(), tx, seed=0)
    batch = lm_batch(batch=16)  # 16: what grad_accum=4 splits over 4 batch shards
    gbatch = jax.device_put(batch, batch_sharding(layout, jaxmp.rules.DEFAULT_RULES, batch))
    grad_fn = jax.jit(make_grad_fn(layout, lm_loss, grad_accum,
                                   sum_in_backward=sum_in_backward))
    loss, grads, _, _ = grad_fn(state.params, state.rest, gbatch)
    step = make_train_step(layout, lm_loss, tx, sched, batch, grad_accum,
                           sum_in_backward=sum_in_backward)
    losses = []
    for _ in range(steps):
        state, m = step(state, gbatch)
        losses.append(float(m["loss"]))
    return loss, grads, state, losses, layout


@pytest.fixture(scope="module")
def reference():
    return _run({}, one_device())


@functools.cache
def _d2f2t2(grad_accum: int = 1):
    """3 steps on data2 x fsdp2 x tensor2 (batch 16), run once per module for the tests that
    compare against it: the sharded-step equivalence (grad_accum 1), full batch against
    accumulation, accumulation against the sum in the backward (grad_accum 4)."""
    return _run(D2F2T2, grad_accum=grad_accum)


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("axes", MESHES, ids=lambda a: "x".join(f"{k}{v}" for k, v in a.items()))
def test_sharded_step_equals_single_device(axes, reference):
    ref_loss, ref_grads, ref_state, ref_losses, _ = reference
    loss, grads, state, losses, _ = _d2f2t2() if axes == D2F2T2 else _run(axes)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
    for g, r in zip(_leaves(grads), _leaves(ref_grads), strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for p, r in zip(_leaves(state.params), _leaves(ref_state.params), strict=True):
        # atol scaled to the leaf: elements that crossed zero have no meaningful rtol
        np.testing.assert_allclose(p, r, rtol=1e-5, atol=1e-5 * np.abs(r).max())


def test_state_is_born_sharded_under_fsdp():
    """Per-device params + optimizer state ≤ 1.02 × total / 8 (read from the shards)."""
    mesh = jaxmp.make_mesh({"fsdp": 8})
    tx = make_optimizer(OPT, 10)
    layout = plan_state(gpt_fn(), tx, mesh)
    state = init_state(layout, gpt_fn(), tx, seed=0)
    total = state_bytes(state)
    assert addressable_bytes(state) <= 1.02 * total / 8
    # every parameter is split: none lives whole on one device
    for x in jax.tree.leaves(state.params):
        if x.ndim >= 2:
            assert x.addressable_shards[0].data.size == x.size // 8


def test_grad_accumulation_equals_full_batch():
    full, accum = _d2f2t2(), _d2f2t2(grad_accum=4)
    np.testing.assert_allclose(float(accum[0]), float(full[0]), rtol=1e-6)
    for a, f in zip(_leaves(accum[1]), _leaves(full[1]), strict=True):
        np.testing.assert_allclose(a, f, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(accum[3], full[3], rtol=1e-5)


def _temp_bytes(layout, grad_accum: int, sum_in_backward: bool) -> int:
    tx = make_optimizer(OPT, 10)
    state = init_state(layout, gpt_fn(), tx, seed=0)
    batch = lm_batch(batch=16)
    gbatch = jax.device_put(batch, batch_sharding(layout, jaxmp.rules.DEFAULT_RULES, batch))
    fn = jax.jit(make_grad_fn(layout, lm_loss, grad_accum, sum_in_backward=sum_in_backward))
    return fn.lower(state.params, state.rest, gbatch).compile().memory_analysis() \
        .temp_size_in_bytes


def test_sum_in_backward_equals_accumulation_and_drops_the_microbatch_gradient():
    """Microbatch gradients added into the float32 sum inside the backward (jaxmp.gradsum):
    the same loss, gradients and params after 3 steps, and the compiled temporaries lose the
    microbatch's whole gradient of the layer stack."""
    plain = _d2f2t2(grad_accum=4)
    into = _run(D2F2T2, grad_accum=4, sum_in_backward=True)
    np.testing.assert_allclose(float(into[0]), float(plain[0]), rtol=1e-6)
    for a, p in zip(_leaves(into[1]), _leaves(plain[1]), strict=True):
        np.testing.assert_allclose(a, p, rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(into[3], plain[3], rtol=1e-6)
    for a, p in zip(_leaves(into[2].params), _leaves(plain[2].params), strict=True):
        np.testing.assert_allclose(a, p, rtol=1e-6, atol=1e-6 * np.abs(p).max())
    layout = plain[4]
    stacked = sum(x.size for x in jax.tree.leaves(layout.abstract.params) if x.ndim == 3)
    fall = _temp_bytes(layout, 4, False) - _temp_bytes(layout, 4, True)
    # float32 grads of the stacked layers, per device (sharded over fsdp x tensor = 4)
    assert fall >= 0.5 * 4 * stacked / 4, (fall, stacked)


class _Dropout(nnx.Module):
    """A model whose forward pass draws random numbers (RNG state lives in TrainState.rest)."""

    def __init__(self, rngs: nnx.Rngs):
        self.w = nnx.Param(jax.random.normal(rngs.params(), (16, 32)) * 0.1,
                           out_sharding=("embed", "mlp"), eager_sharding=False)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.drop(x @ self.w[...])


def _dropout_losses(axes, devices=None):
    mesh = jaxmp.make_mesh(axes, devices)
    tx, sched = make_optimizer(OPT, 10), make_schedule(OPT, 10)
    layout = plan_state(_Dropout, tx, mesh)
    state = init_state(layout, _Dropout, tx, seed=0)
    batch = {"x": np.random.default_rng(0).normal(size=(8, 16)).astype(np.float32)}
    step = make_train_step(layout, lambda m, b: (m(b["x"]) ** 2).mean(), tx, sched, batch)
    losses = []
    for _ in range(3):
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
    return losses, state_bytes(state)


def test_models_with_rng_state_train_and_shard_exactly():
    losses, nbytes = _dropout_losses({}, one_device())
    assert len(set(losses)) == 3 and nbytes > 0  # fresh dropout masks every step
    np.testing.assert_allclose(_dropout_losses({"data": 2, "fsdp": 2, "tensor": 2})[0], losses,
                               rtol=1e-5)


def test_extra_state_is_sharded_like_params_and_checkpointed(tmp_path):
    """An extension's state (here a params-shaped residual and a counter) lives in
    ``TrainState.extra``: sharded by the params' logical names, carried through the step
    unchanged, and saved / restored with the rest of the state."""
    mesh = jaxmp.make_mesh({"fsdp": 8})
    tx = make_optimizer(OPT, 10)
    ext = {"residual": lambda p: jax.tree.map(jax.numpy.zeros_like, p),
           "count": lambda p: jax.numpy.zeros((), jax.numpy.int32)}
    layout = plan_state(gpt_fn(), tx, mesh, extensions=ext)
    param_specs = [s.spec for s in jax.tree.leaves(layout.shardings.params)]
    extra_specs = [s.spec for s in jax.tree.leaves(layout.shardings.extra["residual"])]
    assert extra_specs == param_specs and any(s != jax.sharding.PartitionSpec() for s in extra_specs)
    state = init_state(layout, gpt_fn(), tx, seed=0)
    assert addressable_bytes(state.extra["residual"]) * 8 == state_bytes(state.extra["residual"])
    batch = lm_batch()
    step = make_train_step(layout, lm_loss, tx, make_schedule(OPT, 10), batch)
    state, _ = step(state, jax.device_put(batch, batch_sharding(layout, jaxmp.rules.DEFAULT_RULES,
                                                                batch)))
    assert set(state.extra) == {"residual", "count"} and int(state.step) == 1
    jaxmp.checkpoint.save(tmp_path, 1, state)
    restored = jaxmp.checkpoint.restore(tmp_path, what="state", mesh=mesh)
    assert set(restored["extra"]) == {"residual", "count"}
    for a, b in zip(jax.tree.leaves(restored["extra"]["residual"]),
                    jax.tree.leaves(state.extra["residual"]), strict=True):
        assert a.sharding.spec == b.sharding.spec
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
