"""Fewer bytes on the wire: compressed gradient reductions and narrow weight gathers.

Bytes are read from the compiled programs (``jaxmp.hlo``), on 8 simulated devices; the
reducers' arithmetic is checked on random gradients; the Trainer's state is checked through a
checkpoint and a resume.
"""
from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxmp
from jaxmp.checkpoint import digest, restore
from jaxmp.config import OptimizerConfig
from jaxmp.errors import ConfigError
from jaxmp._util.arrays import tree_bytes
from jaxmp.hlo import collective_stats, partitioned_text
from jaxmp.models import lm_loss
from jaxmp.compression.reduce import (STATE_KEY, Compression, Reducer, bytes_factor, matrix_view,
                                   state_extension)
from jaxmp.plan import make_plan
from jaxmp.recipes.gpt import gpt_costs, gpt_trainer, lm_batches
from jaxmp.train.loop import Trainer
from jaxmp.train.optimizer import make_optimizer, make_schedule
from jaxmp.train.state import init_state, plan_state
from jaxmp.train.step import batch_sharding, make_train_step
from helpers import gpt_fn, lm_batch, one_device
from test_checkpoint_helpers import TINY_GPT, Bigram
from test_checkpoint_resume import Recorder

N = 8
# The test GPT of test_comm.py (untied head: every gradient is reduced exactly once).
GPT = ["model.layers=2", "model.d_model=64", "model.heads=8", "model.mlp_dim=256",
       "model.vocab_size=256", "model.tie_embeddings=false", "data.seq_len=16",
       "train.batch_size=16", "checkpoint.enabled=false"]
_PROGRAMS: dict[tuple, tuple] = {}


def _trainer(sets):
    return gpt_trainer(jaxmp.load_config(None, GPT + list(sets)), "unused", with_data=False)


def _compiled(*sets: str):
    """(compiled step, trainer) of the test GPT with ``sets``, compiled once per module run."""
    if sets not in _PROGRAMS:
        trainer = _trainer(sets)
        _PROGRAMS[sets] = trainer.compile(), trainer
    return _PROGRAMS[sets]


def _bytes(*sets: str) -> float:
    return collective_stats(_compiled(*sets)[0]).total_bytes


# -- compression "none" is today's program --------------------------------------------------


def _program(compiled) -> str:
    """The compiled HLO without source locations (which name the calling frames)."""
    text = compiled.as_text().split("\nFileNames")[0]
    return re.sub(r", metadata=\{[^}]*\}", "", text)


def test_none_compiles_to_the_same_program_as_before():
    compiled, trainer = _compiled("mesh.data=8")
    plain = make_train_step(trainer.layout, lm_loss, trainer.tx, trainer.lr_schedule,
                            trainer.example_batch, 1, trainer.rules, 0,
                            guard=trainer.guard)
    assert _program(compiled) == _program(plain.lower(trainer.layout.abstract,
                                                      trainer.example_batch).compile())
    assert STATE_KEY not in trainer.layout.abstract.extra


# -- bytes per step, from the compiled program ---------------------------------------------


def _leaves(trainer) -> list:
    leaves, _ = jaxmp.sharding.tree_leaves(trainer.layout.abstract.params)
    return leaves


def test_bf16_and_int8_cut_the_data_reduction():
    f32 = _bytes("mesh.data=8")
    params = tree_bytes(_compiled("mesh.data=8")[1].layout.abstract.params)
    assert f32 == pytest.approx(2 * (N - 1) / N * params, rel=0.01)
    bf16 = _bytes("mesh.data=8", "compression.gradients=bfloat16")
    int8 = _bytes("mesh.data=8", "compression.gradients=int8")
    assert bf16 <= 0.52 * f32, bf16 / f32
    assert int8 <= 0.30 * f32, int8 / f32
    kinds = collective_stats(_compiled("mesh.data=8", "compression.gradients=int8")[0])
    assert kinds.bytes_by_kind["all-to-all"] > 0 and kinds.bytes_by_kind["all-reduce"] < 100


def test_powersgd_sends_its_rank_formula():
    rank = 4
    sets = ("mesh.data=8", "compression.gradients=powersgd", f"compression.powersgd_rank={rank}")
    compiled, trainer = _compiled(*sets)
    floats = 0
    for leaf in _leaves(trainer):
        view = matrix_view(leaf.shape, leaf.names, rank)
        if view is None:
            floats += math.prod(leaf.shape)
        else:
            b = math.prod(leaf.shape[:view.batch])
            floats += b * rank * (math.prod(leaf.shape[view.batch:view.split])
                                  + math.prod(leaf.shape[view.split:]))
    formula = 2 * (N - 1) / N * 4 * floats
    sent = collective_stats(compiled).total_bytes
    assert sent == pytest.approx(formula, rel=0.10), (sent, formula)
    assert sent < 0.2 * _bytes("mesh.data=8")
    leaves = [(leaf.shape, leaf.names) for leaf in _leaves(trainer)]
    params = tree_bytes(trainer.layout.abstract.params)
    assert bytes_factor(Compression("powersgd", rank=rank), leaves) == pytest.approx(
        formula / (2 * (N - 1) / N * params), rel=1e-6)


def test_gradient_accumulation_reduces_over_data_once_per_step():
    once = collective_stats(_compiled("mesh.data=8")[0])
    sets = ("mesh.data=8", "train.microbatches=4", "train.batch_size=32")
    compiled, trainer = _compiled(*sets)
    accum = collective_stats(compiled)
    assert accum.total_bytes <= 1.01 * once.total_bytes
    assert all(op.multiplier == 1 for op in accum.ops)  # none inside the microbatch loop
    # Before: XLA all-reduced every microbatch's gradient inside the loop.
    old = make_train_step(trainer.layout, lm_loss, trainer.tx, trainer.lr_schedule,
                          trainer.example_batch, 4, trainer.rules, 0)
    before = collective_stats(old.lower(trainer.layout.abstract, trainer.example_batch))
    assert before.total_bytes >= 3.9 * once.total_bytes


def test_weight_gathers_move_bf16_under_a_bf16_model():
    """fsdp8: the all-gathers of a bfloat16-compute model move half the bytes of a float32
    model's, as partitioned (XLA's CPU backend widens bf16 collectives afterwards)."""

    def gathered(*sets: str) -> float:
        trainer = _trainer(("mesh.fsdp=8",) + sets)
        step = make_train_step(trainer.layout, lm_loss, trainer.tx, trainer.lr_schedule,
                               trainer.example_batch, 1, trainer.rules, 0, gather=trainer.gather)
        text = partitioned_text(step.lower(trainer.layout.abstract, trainer.example_batch))
        return collective_stats(text).bytes_by_kind["all-gather"]

    f32 = gathered()
    assert gathered("model.compute_dtype=bfloat16") <= 0.52 * f32
    assert gathered("model.compute_dtype=bfloat16", "compression.weights=int8") <= 0.30 * f32


@pytest.mark.parametrize("sets,tolerance", [((), 0.01), (("compression.gradients=int8",), 0.03),
                                            (("compression.gradients=powersgd",), 0.10),
                                            (("train.microbatches=4", "train.batch_size=32"), 0.01)])
def test_planner_predicts_the_bytes_the_step_sends(sets, tolerance):
    """The planner's data-axis bytes (once per step, scaled by the compression) against the
    compiled data8 step, whose only collectives are the gradient reduction."""
    sets = ("mesh.data=8",) + sets
    config = jaxmp.load_config(None, GPT + list(sets))
    predicted = make_plan(config, gpt_costs(config), N).predicted.comm_bytes
    assert predicted["data"] == pytest.approx(_bytes(*sets), rel=tolerance)


# -- the reducers' arithmetic ---------------------------------------------------------------


def _reducer_setup(axes: dict, comp: Compression):
    mesh = jaxmp.make_mesh(axes, jax.devices()[:math.prod(axes.values())])
    tx = make_optimizer(OptimizerConfig(), 10)
    ext = {STATE_KEY: state_extension(comp, mesh.shape["data"])} if comp.stateful else {}
    layout = plan_state(gpt_fn(), tx, mesh, extensions=ext)
    state = init_state(layout, gpt_fn(), tx, seed=0)
    reducer = Reducer(comp, mesh, layout.abstract.params, layout.shardings.params)
    return mesh, layout, state, jax.jit(reducer)


def _stacked(layout, seed: int, rank_one: bool = False):
    """Random per-replica gradients [data, *shape], sharded (data, *param spec)."""
    mesh, d = layout.mesh, layout.mesh.shape["data"]
    rng = np.random.default_rng(seed)
    out = []
    leaves, _ = jaxmp.sharding.tree_leaves(layout.abstract.params)
    for leaf, s in zip(leaves, jax.tree.leaves(layout.shardings.params), strict=True):
        shape, names = (d,) + leaf.shape, leaf.names
        x = rng.normal(size=shape).astype(np.float32)
        view = matrix_view(leaf.shape, names, 2)
        if rank_one and view is not None:  # replica i sends a_i b^T: the sum is rank one
            cols = len(leaf.shape) - view.split
            a = rng.normal(size=shape[:1 + view.split] + (1,) * cols)
            b = rng.normal(size=(1,) + leaf.shape[:view.batch] + (1,) * (view.split - view.batch)
                           + leaf.shape[view.split:])
            x = (a * b).astype(np.float32)
        out.append(jax.device_put(x, NamedSharding(mesh, P("data", *s.spec))))
    return jax.tree.unflatten(jax.tree.structure(layout.abstract.params), out)


def _sum(stacked):
    return [np.asarray(x).sum(0) for x in jax.tree.leaves(stacked)]


def _residuals(layout, extra) -> list[np.ndarray]:
    """Each param's residual summed over data replicas, in the params' order."""
    res = extra[STATE_KEY]["residual"]
    leaves, _ = jaxmp.sharding.tree_leaves(layout.abstract.params)
    return [np.asarray(res[leaf.path.replace("/", ".")][...]).sum(0) for leaf in leaves]


@pytest.mark.parametrize("kind", ["bfloat16", "int8"])
def test_encoded_sums_are_close_to_exact(kind):
    _, layout, state, reduce = _reducer_setup({"data": N}, Compression(kind))
    stacked = _stacked(layout, 0)
    out, _ = reduce(stacked, state.extra)
    for got, want in zip(jax.tree.leaves(out), _sum(stacked)):
        err = np.linalg.norm(np.asarray(got) - want) / np.linalg.norm(want)
        assert err < (4e-3 if kind == "bfloat16" else 1.5e-2), err


@pytest.mark.parametrize("kind,axes", [("int8", {"data": N}),
                                       ("int8", {"data": 2, "fsdp": 2, "tensor": 2}),
                                       ("powersgd", {"data": 4, "fsdp": 2})])
def test_error_feedback_keeps_what_was_dropped(kind, axes):
    """Over two steps: inputs + old residuals == output + new residuals (summed over data)."""
    _, layout, state, reduce = _reducer_setup(axes, Compression(kind, rank=2))
    _, extra = reduce(_stacked(layout, 1), state.extra)
    old = _residuals(layout, extra)
    stacked = _stacked(layout, 2)
    out, extra = reduce(stacked, extra)
    new = _residuals(layout, extra)
    for got, inputs, before, after in zip(jax.tree.leaves(out), _sum(stacked), old, new,
                                          strict=True):
        lhs, rhs = inputs + before, np.asarray(got) + after
        np.testing.assert_allclose(lhs, rhs, atol=1e-5 * np.abs(lhs).max())


def test_powersgd_is_exact_on_rank_one_gradients_and_on_any_mesh():
    comp = Compression("powersgd", error_feedback=False, rank=2)
    results = []
    for axes in ({"data": 2}, {"data": 2, "fsdp": 2, "tensor": 2}):
        _, layout, state, reduce = _reducer_setup(axes, comp)
        stacked = _stacked(layout, 3, rank_one=True)
        out, _ = reduce(stacked, state.extra)
        for got, want in zip(jax.tree.leaves(out), _sum(stacked)):
            np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4,
                                       atol=1e-5 * np.abs(want).max())
        full, _ = reduce(_stacked(layout, 4), state.extra)  # full rank: rank-2 approximations
        results.append([np.asarray(x) for x in jax.tree.leaves(full)])
    for a, b in zip(*results):  # rows / columns split over fsdp and tensor: the same numbers
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * np.abs(b).max())


def test_accumulated_per_replica_step_equals_one_device():
    """Reducer "none" with grad_accum=4 on data2 x fsdp2 x tensor2 == the full batch on one
    device (float32)."""
    opt = OptimizerConfig(lr=1e-3, warmup_steps=1, eps=1e-4)
    batch = lm_batch(batch=16)

    def run(axes, devices, accum, reduce):
        mesh = jaxmp.make_mesh(axes, devices)
        tx, sched = make_optimizer(opt, 10), make_schedule(opt, 10)
        layout = plan_state(gpt_fn(), tx, mesh)
        reducer = Reducer(Compression(), mesh, layout.abstract.params,
                          layout.shardings.params) if reduce else None
        step = make_train_step(layout, lm_loss, tx, sched, batch, accum, reducer=reducer)
        state = init_state(layout, gpt_fn(), tx, seed=0)
        gbatch = jax.device_put(batch, batch_sharding(layout, jaxmp.rules.DEFAULT_RULES, batch))
        losses = []
        for _ in range(2):
            state, m = step(state, gbatch)
            losses.append(float(m["loss"]))
        return losses, jax.tree.leaves(state.params)

    ref_losses, ref = run({}, one_device(), 1, False)
    losses, params = run({"data": 2, "fsdp": 2, "tensor": 2}, None, 4, True)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for p, r in zip(params, ref, strict=True):
        np.testing.assert_allclose(np.asarray(p), np.asarray(r), rtol=1e-5,
                                   atol=1e-5 * np.abs(np.asarray(r)).max())


# -- the Trainer: state, checkpoints, resume, bad input -------------------------------------

RESUME = TINY_GPT + ["train.steps=4", "checkpoint.every=2", "mesh.data=4", "compression.powersgd_start=1"]


def _fit(run_dir, sets, signal_at=None):
    config = jaxmp.load_config(None, RESUME + list(sets))
    data = Recorder(lm_batches(config), signal_at)
    trainer = Trainer(config, lambda rngs: Bigram(256, 32, rngs), lm_loss, data,
                      run_dir=run_dir, devices=jax.devices()[:4], model_flops_per_token=1.0)
    trainer.fit()
    return trainer


@pytest.mark.parametrize("kind", ["int8", "powersgd"])
def test_compression_state_is_checkpointed_and_resume_is_bitwise(kind, tmp_path):
    sets = [f"compression.gradients={kind}"]
    ref = _fit(tmp_path / "ref", sets)
    state = ref.state.extra[STATE_KEY]
    assert "residual" in state and (kind != "powersgd" or "q" in state)
    residual = state["residual"]["embed"][...]
    assert residual.shape == (4, 256, 32) and residual.sharding.spec[0] == "data"
    assert float(jnp.abs(residual).max()) > 0  # error feedback is carrying something
    saved = restore(tmp_path / "ref", what="state", mesh=ref.mesh)
    np.testing.assert_array_equal(np.asarray(saved["extra"][STATE_KEY]["residual"]["embed"]),
                                  np.asarray(residual))

    first = _fit(tmp_path / "run", sets, signal_at=2)  # preempted after step 2, checkpointed
    assert int(first.state.step) == 3  # step 2 finished, then stopped and saved
    second = _fit(tmp_path / "run", sets)
    assert second.data.read == [3]
    assert digest(second.state) == digest(ref.state)  # params, Adam, residuals, Q: every bit


def test_batch_that_does_not_split_over_replicas_is_bad_input(tmp_path):
    config = jaxmp.load_config(None, TINY_GPT + ["mesh.data=4", "train.batch_size=6",
                                                 "compression.gradients=bfloat16"])
    with pytest.raises(ConfigError, match=r"train.batch_size: 6 does not divide over the 4 batch shards"):
        Trainer(config, lambda rngs: Bigram(256, 32, rngs), lm_loss, None, run_dir=tmp_path,
                devices=jax.devices()[:4])


def test_compression_composes_with_pipeline_stages():
    """stage2 x data2 x fsdp2: the pipeline's gradients per data replica, int8-reduced; the
    loss of the step is the uncompressed one (the reduction only changes the update)."""
    sets = ("mesh.data=2", "mesh.stage=2", "mesh.fsdp=2", "train.microbatches=2",
            "optimizer.warmup_steps=1")
    losses = {}
    for kind in ("none", "int8"):
        trainer = _trainer(sets + (f"compression.gradients={kind}",))
        batch = {k: jax.device_put(v, NamedSharding(trainer.mesh, P(("data", "fsdp"))))
                 for k, v in lm_batch(batch=16).items()}
        state = init_state(trainer.layout, trainer.model_fn, trainer.tx, 0)
        step = trainer.compile(batch)
        out = []
        for _ in range(3):
            state, m = step(state, batch)
            out.append(float(m["loss"]))
        losses[kind] = out
    assert losses["none"][0] == pytest.approx(losses["int8"][0], rel=1e-5)
    assert losses["none"][2] == pytest.approx(losses["int8"][2], rel=1e-3)
    assert losses["int8"][2] < losses["int8"][0] - 0.05
