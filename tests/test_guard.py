"""The non-finite guard: NaN/inf steps change nothing but the counters; finite steps are
bit-for-bit the unguarded ones; too many in a row stop the run; nothing non-finite is saved."""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxmp
from jaxmp.checkpoint import digest, list_steps, restore
from jaxmp.config import OptimizerConfig
from jaxmp.models import lm_loss
from jaxmp.recipes.gpt import lm_batches
from jaxmp.train import guard as guard_mod
from jaxmp.train.guard import NonFiniteError, NonFiniteGuard
from jaxmp.train.checkpointing import TrainCheckpointer
from jaxmp.train.loop import Trainer
from jaxmp.train.optimizer import make_optimizer, make_schedule
from jaxmp.train.state import init_state, plan_state
from jaxmp.train.step import batch_sharding, make_train_step
from helpers import lm_batch
from test_checkpoint_helpers import TINY_GPT, Bigram

OPT = OptimizerConfig(lr=1e-2, warmup_steps=1)
MESH = {"data": 2, "fsdp": 2, "tensor": 2}
FINE, NAN_LOSS, NAN_GRAD = 0, 1, 2


def model_fn(rngs):
    return Bigram(256, 32, rngs)


def poisoned_loss(model, batch):
    """``lm_loss``, made non-finite on request: ``poison`` 1 → NaN loss, 2 → finite loss but
    NaN gradient (d sqrt(x)/dx at 0, times 0); 0 → exactly ``lm_loss``."""
    loss, aux = lm_loss(model, batch)
    kind = batch["poison"].max()
    w0 = jax.tree.leaves(nnx.state(model, nnx.Param))[0].reshape(-1)[0]
    x = jnp.where(kind == NAN_GRAD, 0.0 * w0, 1.0 + 0.0 * w0)
    nan_grad = jnp.sqrt(x) - jax.lax.stop_gradient(jnp.sqrt(x))  # value 0
    return jnp.where(kind == NAN_LOSS, jnp.nan, loss) + nan_grad, aux


def batch_with(kind: int, seed: int = 0) -> dict:
    b = lm_batch(batch=8, seed=seed)
    return {**b, "poison": np.full((8,), kind, np.int32)}


def _setup(guard: NonFiniteGuard | None, loss=poisoned_loss):
    mesh = jaxmp.make_mesh(MESH)
    tx, sched = make_optimizer(OPT, 20), make_schedule(OPT, 20)
    ext = {guard_mod.KEY: NonFiniteGuard.extension} if guard else {}
    layout = plan_state(model_fn, tx, mesh, extensions=ext)
    state = init_state(layout, model_fn, tx, seed=0)
    example = batch_with(FINE)
    step = make_train_step(layout, loss, tx, sched, example, guard=guard)
    shard = batch_sharding(layout, jaxmp.rules.DEFAULT_RULES, example)
    return state, step, lambda b: jax.device_put(b, shard)


def _host(tree) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def _assert_same(a, b) -> None:
    for x, y in zip(_host(a), _host(b), strict=True):
        np.testing.assert_array_equal(x, y)


def test_finite_steps_are_bitwise_the_unguarded_ones():
    plain, plain_step, put = _setup(None, lm_loss)
    guarded, guarded_step, _ = _setup(NonFiniteGuard(3), lm_loss)
    for seed in range(4):
        b = put(batch_with(FINE, seed))
        plain, m_plain = plain_step(plain, b)
        guarded, m_guarded = guarded_step(guarded, b)
        assert float(m_plain["loss"]) == float(m_guarded["loss"])
        assert int(m_guarded["skipped_steps"]) == 0
    for part in ("params", "opt_state", "rest"):
        _assert_same(getattr(guarded, part), getattr(plain, part))
    assert int(guarded.step) == int(plain.step) == 4


@pytest.mark.parametrize("kind", [NAN_LOSS, NAN_GRAD], ids=["nan-loss", "nan-grad"])
def test_a_non_finite_step_changes_nothing_but_the_counters(kind):
    state, step, put = _setup(NonFiniteGuard(3))
    state, _ = step(state, put(batch_with(FINE, 0)))
    before = jax.tree.map(np.asarray, (state.params, state.opt_state, state.rest))
    state, m = step(state, put(batch_with(kind, 1)))
    if kind == NAN_GRAD:
        assert np.isfinite(float(m["loss"])) and not np.isfinite(float(m["grad_norm"]))
    _assert_same((state.params, state.opt_state, state.rest), before)
    assert int(state.step) == 2 and int(m["skipped_steps"]) == 1 and int(m["skip_streak"]) == 1
    state, m = step(state, put(batch_with(FINE, 2)))  # training goes on, the streak resets
    assert int(m["skipped_steps"]) == 1 and int(m["skip_streak"]) == 0
    assert not np.array_equal(np.asarray(jax.tree.leaves(state.params)[0]),
                              jax.tree.leaves(before[0])[0])
    NonFiniteGuard(3).check(state)  # not latched: no error


def test_max_skipped_in_a_row_latches_and_is_refused():
    g = NonFiniteGuard(2)
    state, step, put = _setup(g)
    state, _ = step(state, put(batch_with(FINE, 0)))
    kept = _host(state.params)
    for kind in (NAN_LOSS, NAN_GRAD, FINE):  # the third step is finite but the guard latched
        state, m = step(state, put(batch_with(kind, 3)))
    assert int(state.step) == 4 and int(m["skipped_steps"]) == 3
    _assert_same(state.params, kept)
    with pytest.raises(NonFiniteError, match=r"2 consecutive steps \(2\.\.3\).*max_skipped=2"):
        g.check(state)


def test_a_state_holding_inf_is_never_saved(tmp_path):
    """The step guard looks at loss and gradients; an update can still overflow, so every
    save checks what it is about to write."""
    mesh = jaxmp.make_mesh(MESH)
    tx = make_optimizer(OPT, 20)
    ext = {guard_mod.KEY: NonFiniteGuard.extension}
    layout = plan_state(model_fn, tx, mesh, extensions=ext)
    state = init_state(layout, model_fn, tx, seed=0)
    config = jaxmp.load_config(None, TINY_GPT + ["checkpoint.async_save=false"])
    ckpt = TrainCheckpointer(tmp_path, config, layout)
    bad = state.replace(params=jax.tree.map(lambda x: x * jnp.inf, state.params))
    with pytest.raises(NonFiniteError, match=r"step 1 holds non-finite values \(in params/"):
        ckpt.maybe_save(1, bad, force=True)
    assert ckpt.maybe_save(2, state, force=True)  # a finite state saves
    ckpt.close()
    assert [s.step for s in list_steps(tmp_path)] == [2]


class Poisoner:
    """The token stream, with ``poison`` set on every batch from global step ``start`` on."""

    def __init__(self, inner, start: int):
        self.inner, self.start = inner, start

    def __iter__(self):
        return self

    def __next__(self):
        kind = NAN_LOSS if self.inner.step >= self.start else FINE
        b = next(self.inner)
        return {**b, "poison": np.full((b["inputs"].shape[0],), kind, np.int32)}

    def get_state(self):
        return self.inner.get_state()

    def set_state(self, state):
        self.inner.set_state(state)


def test_trainer_stops_after_max_skipped_and_saves_nothing_non_finite(tmp_path):
    config = jaxmp.load_config(None, TINY_GPT + [
        "train.steps=20", "train.max_skipped=3", "checkpoint.every=2", "checkpoint.keep=10",
        "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"])
    trainer = Trainer(config, model_fn, poisoned_loss, Poisoner(lm_batches(config), 4),
                      run_dir=tmp_path, model_flops_per_token=1.0)
    with pytest.raises(NonFiniteError, match=r"3 consecutive steps \(5\.\.7\)"):
        trainer.fit()
    # steps 5 and 6 were skipped before the guard latched at 7: checkpoint 6 holds step 4's
    # arrays; nothing was saved after the latch
    assert [s.step for s in list_steps(tmp_path) if s.complete] == [2, 4, 6]
    params = {s: digest({"p": restore(tmp_path, step=s)}) for s in (4, 6)}
    assert params[4] == params[6]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped_steps"] for r in records] == [0, 0, 0, 0, 1, 2, 3]
    assert records[5]["loss"] is None  # NaN is written as null
