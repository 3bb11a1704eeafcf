"""Pipeline parallelism (mesh.stage > 1): schedules, FLOP-balanced uneven stages, equivalence
with the non-pipelined step in float32, forward-only evaluation in eval mode, residuals without
parameter copies, memory by schedule, bad input, checkpoints that move between pipelined and
plain layouts."""
from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxmp
from jaxmp import sharding
from jaxmp.checkpoint.records import flat_paths, to_plain
from jaxmp.config import OptimizerConfig
from jaxmp.errors import ConfigError
from jaxmp.hlo import collective_stats
from jaxmp.models import lm_loss, next_token_loss
from jaxmp.pipeline.chunk import PipelineSpec, to_stages
from jaxmp.pipeline.executor import PipelineExecutor
from jaxmp.pipeline.residuals import stash_policy, vjp_without_params, with_params
from jaxmp.pipeline.schedule import Schedule
from jaxmp.pipeline.stages import split_layers
from jaxmp.recipes.gpt import gpt_trainer
from jaxmp.train.optimizer import make_optimizer
from jaxmp.train.state import init_state, plan_state
from jaxmp.train.step import batch_sharding, make_eval_step, make_grad_fn
from helpers import TINY, gpt_fn, lm_batch, one_device

SPEC = PipelineSpec("blocks", pre=lambda m, b: m.embed_tokens(b["inputs"]),
                    post=lambda m, x, b: next_token_loss(m.logits(x), b), token_ids=("inputs",))
OPT = OptimizerConfig(lr=1e-3, warmup_steps=1, eps=1e-4)


# ---------------------------------------------------------------- the schedule description

@pytest.mark.parametrize("kind,virtual", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2),
                                          ("interleaved", 3)])
def test_closed_forms_equal_the_tick_tables(kind, virtual):
    """The planner's numbers (ticks, microbatches in flight, step time) are the executor's."""
    for p in (2, 3, 4, 8):
        for m in range(p, 4 * p + 1):
            if kind == "interleaved" and m % p:
                continue
            s = Schedule(kind, p, m, virtual)
            assert len(s.events) == s.n_ticks
            done_f, done_b, peak = [0] * p, [0] * p, [0] * p
            for row in s.events:
                for d, (f, b) in enumerate(row):
                    done_f[d] += f is not None
                    peak[d] = max(peak[d], done_f[d] - done_b[d])
                    done_b[d] += b is not None
            assert peak == [s.in_flight(d) for d in range(p)]
            # every chunk equally fast (forward 1, backward 2): the bubble is (P-1)/(V·M+P-1)
            t = s.lockstep_time([1.0] * s.chunks, [2.0] * s.chunks)
            assert t == pytest.approx(3 * s.step_units())
            assert 1 - 3 * m * virtual / t == pytest.approx(s.bubble_fraction)
            s.program()  # every slot is assigned


def test_1f1b_and_interleaved_bound_what_is_in_flight():
    gpipe, one, inter = (Schedule("gpipe", 4, 16), Schedule("1f1b", 4, 16),
                         Schedule("interleaved", 4, 16, 2))
    assert gpipe.in_flight(0) == 16 and one.in_flight(0) == 7 and one.in_flight(3) == 1
    assert inter.bubble_fraction < one.bubble_fraction == gpipe.bubble_fraction


@pytest.mark.parametrize("args,key", [
    (("1f1b", 4, 2), "train.microbatches"), (("interleaved", 2, 4, 1), "virtual_stages"),
    (("interleaved", 4, 6, 2), "train.microbatches"), (("gpipe", 2, 4, 2), "virtual_stages"),
    (("zigzag", 2, 4), "pipeline.schedule")])
def test_impossible_schedules_are_bad_input(args, key):
    with pytest.raises(ConfigError, match=key):
        Schedule(*args)


def test_flop_balanced_split_gives_a_heavy_head_fewer_blocks():
    costs = [0.0] + [1.0] * 8 + [3.0]  # pre, 8 equal blocks, a head worth three blocks
    flops = split_layers(costs, 2, balance="flops")
    layers = split_layers(costs, 2, balance="layers")
    assert flops.per_chunk == [6, 2] and layers.per_chunk == [4, 4]
    assert max(sum(costs[a:b]) for a, b in flops.bounds) < \
        max(sum(costs[a:b]) for a, b in layers.bounds)
    rows = flops.rows
    assert rows.shape == (2, 6) and list(rows[1]) == [6, 7, -1, -1, -1, -1]
    assert sorted(flops.flat_index()) == list(flops.flat_index()) == [0, 1, 2, 3, 4, 5, 6, 7]
    with pytest.raises(ConfigError, match="model.layers"):
        split_layers([0.0, 1.0, 1.0, 0.0], 2, virtual=2)


# ---------------------------------------------------------------- equal to one device

@pytest.fixture(scope="module")
def reference():
    """Loss and gradients of one step of the 6-layer test GPT on one device."""
    cfg = dataclasses.replace(TINY, layers=6)
    tx = make_optimizer(OPT, 10)
    layout = plan_state(gpt_fn(cfg), tx, jaxmp.make_mesh({}, one_device()))
    state = init_state(layout, gpt_fn(cfg), tx, 0)
    loss, grads, _, _ = jax.jit(make_grad_fn(layout, jaxmp.models.lm_loss))(
        state.params, state.rest, lm_batch(batch=16))
    return cfg, tx, float(loss), grads


# A "1f1b-2-uneven" case (1f1b, 2 stages, 4 microbatches, data 2, FLOP-balanced) ran here too:
# 1f1b on 2 stages x 4 microbatches, FLOP-balanced, is run by the fsdp2-tensor2 and selective
# cases, and the data axis under stages (reduced once, after any schedule) by interleaved-2x2.
CASES = {  # schedule, stages, microbatches, virtual, other axes, balance costs
    "gpipe-2-even": ("gpipe", 2, 2, 1, {}, "layers"),
    "1f1b-4-uneven": ("1f1b", 4, 8, 1, {}, "flops"),
    "interleaved-2x2": ("interleaved", 2, 4, 2, {"data": 2}, "flops"),
    "1f1b-2-fsdp2-tensor2": ("1f1b", 2, 4, 1, {"fsdp": 2, "tensor": 2}, "flops"),
}


@pytest.mark.parametrize("case", [*CASES, "1f1b-2-tensor2-selective"])
def test_pipelined_gradients_equal_one_device(case, reference):
    """Each schedule's gradients equal one device's; "selective" (the stash keeps no S x S
    attention array, the backward recomputes the core) too."""
    cfg, tx, ref_loss, ref_grads = reference
    spec = dataclasses.replace(SPEC, remat="selective") if "selective" in case else SPEC
    kind, p, m, v, axes, balance = CASES.get(case) or ("1f1b", 2, 4, 1, {"tensor": 2}, "flops")
    costs = [0.0] + [1.0] * cfg.layers + [2.5]  # a head worth 2.5 blocks: uneven by FLOPs
    split = split_layers(costs, p, v, balance)
    if balance == "flops":
        assert len(set(split.per_chunk)) > 1, split.per_chunk  # really uneven
    n = p * int(np.prod(list(axes.values()) or [1]))
    mesh = jaxmp.make_mesh({"stage": p, **axes}, jax.devices()[:n])
    layout = plan_state(gpt_fn(cfg), tx, mesh,
                        transform=lambda params: to_stages(params, SPEC, split))
    state = init_state(layout, gpt_fn(cfg), tx, 0)
    grad_fn = PipelineExecutor(layout.graphdef, mesh, spec, Schedule(kind, p, m, v),
                               split).grad_fn(sharding.DEFAULT_RULES)
    batch = lm_batch(batch=16)
    gbatch = jax.device_put(batch, batch_sharding(layout, sharding.DEFAULT_RULES, batch))
    loss, grads, _, _ = jax.jit(grad_fn)(state.params, state.rest, gbatch)
    np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-6)
    index = split.flat_index()
    for g, r in zip(jax.tree.leaves(grads["blocks"]), jax.tree.leaves(ref_grads["blocks"]),
                    strict=True):
        np.testing.assert_allclose(np.asarray(to_plain(g, index)), np.asarray(r), rtol=1e-5,
                                   atol=1e-6 * np.abs(np.asarray(r)).max())
    for key in ("embed", "final_norm"):
        for g, r in zip(jax.tree.leaves(grads[key]), jax.tree.leaves(ref_grads[key]),
                        strict=True):
            np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5,
                                       atol=1e-6 * np.abs(np.asarray(r)).max())


def test_bfloat16_microbatch_gradients_sum_in_float32_like_the_plain_loop():
    """16-bit params: the executor sums its microbatches' gradients in float32 and returns
    that sum (``wide_grads``, what a float32 master updates with), as the plain accumulation
    loop does. Each microbatch's gradient is bfloat16 in both (the backward pass's dtype), so
    the two differ only where float32 summation noise rounds an element of one microbatch's
    gradient to the neighbouring bfloat16 (measured: up to ~1 in 10^3 elements, each by at
    most one bfloat16 step); summed in bfloat16, most elements differ."""
    cfg = dataclasses.replace(TINY, param_dtype="bfloat16", compute_dtype="float32")
    tx, m, batch = make_optimizer(OPT, 10), 2, lm_batch(batch=8)
    plain = plan_state(gpt_fn(cfg), tx, jaxmp.make_mesh({}, one_device()))
    state = init_state(plain, gpt_fn(cfg), tx, 0)
    _, ref, _, _ = jax.jit(make_grad_fn(plain, lm_loss, m, wide_grads=True))(
        state.params, state.rest, batch)
    split = split_layers([0.0] + [1.0] * cfg.layers + [0.0], 2)
    mesh = jaxmp.make_mesh({"stage": 2}, jax.devices()[:2])
    layout = plan_state(gpt_fn(cfg), tx, mesh,
                        transform=lambda params: to_stages(params, SPEC, split))
    staged = init_state(layout, gpt_fn(cfg), tx, 0)
    grad_fn = PipelineExecutor(layout.graphdef, mesh, SPEC, Schedule("1f1b", 2, m, 1),
                               split).grad_fn(sharding.DEFAULT_RULES, wide_grads=True)
    gbatch = jax.device_put(batch, batch_sharding(layout, sharding.DEFAULT_RULES, batch))
    grads = jax.jit(grad_fn)(staged.params, staged.rest, gbatch)[1]
    index = split.flat_index()
    mine = dict(nnx.to_pure_dict(grads))
    mine["blocks"] = jax.tree.map(lambda a: to_plain(a, index), mine["blocks"])
    for g, r in zip(jax.tree.leaves(mine), jax.tree.leaves(nnx.to_pure_dict(ref)), strict=True):
        assert g.dtype == r.dtype == jnp.float32
        g, r = np.asarray(g), np.asarray(r)
        diff, scale = np.abs(g - r), np.abs(r).max()
        assert (diff > 1e-5 * scale).mean() <= 1e-2
        assert diff.max() <= scale * 2.0 ** -7  # one bfloat16 step of the largest element


# ---------------------------------------------------------------- evaluation, forward only

def _staged(model_fn, spec, split, mesh, tx):
    layout = plan_state(model_fn, tx, mesh, transform=lambda params: to_stages(params, spec, split))
    return layout, init_state(layout, model_fn, tx, 0)


def _eval_loss(layout, state, loss_fn, batch, pipeline_loss=None) -> float:
    step = make_eval_step(layout, loss_fn, batch, pipeline_loss=pipeline_loss)
    return float(step(state, jax.device_put(batch, batch_sharding(layout, sharding.DEFAULT_RULES,
                                                                 batch))))


EVAL_CASES = {  # schedule, stages, microbatches, virtual, other axes
    "gpipe-4-fewer-microbatches": ("gpipe", 4, 2, 1, {}),
    "1f1b-2-data2": ("1f1b", 2, 4, 1, {"data": 2}),
    "interleaved-2x3": ("interleaved", 2, 4, 3, {}),  # the ring from the last device back
}


@pytest.mark.parametrize("case", list(EVAL_CASES))
def test_pipelined_evaluation_equals_one_device(case, reference):
    """The forward-only fill-drain gives the plain evaluation step's loss, chunks uneven."""
    cfg, tx = reference[:2]
    kind, p, m, v, axes = EVAL_CASES[case]
    split = split_layers([0.0] + [1.0] * cfg.layers + [2.5], p, v)
    batch = lm_batch(batch=16)
    plain = plan_state(gpt_fn(cfg), tx, jaxmp.make_mesh({}, one_device()))
    expected = _eval_loss(plain, init_state(plain, gpt_fn(cfg), tx, 0), lm_loss, batch)
    n = p * int(np.prod(list(axes.values()) or [1]))
    mesh = jaxmp.make_mesh({"stage": p, **axes}, jax.devices()[:n])
    layout, state = _staged(gpt_fn(cfg), SPEC, split, mesh, tx)
    executor = PipelineExecutor(layout.graphdef, mesh, SPEC, Schedule(kind, p, m, v), split)
    got = _eval_loss(layout, state, lm_loss, batch, executor.eval_fn(sharding.DEFAULT_RULES))
    np.testing.assert_allclose(got, expected, rtol=1e-6)


class _DropoutBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(32, 32, rngs=rngs)
        self.dropout = nnx.Dropout(0.5)  # draws from the rngs it is called with

    def __call__(self, x, rngs=None):
        return x + self.dropout(jnp.tanh(self.linear(x)), rngs=rngs)


class _DropoutLM(nnx.Module):
    """An LM written the ordinary Flax way, with dropout after the embedding and in each block."""

    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(256, 32, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)

        @nnx.split_rngs(splits=4)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def blocks(rngs: nnx.Rngs) -> _DropoutBlock:
            return _DropoutBlock(rngs)

        self.blocks = blocks(rngs)
        self.head = nnx.Linear(32, 256, rngs=rngs)

    def __call__(self, tokens, rngs=None):
        x = self.dropout(self.embed(tokens))
        graphdef, stacked = nnx.split(self.blocks)
        for i in range(4):
            x = nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], stacked))(x, rngs=rngs)
        return self.head(x)


def _dropout_loss(model, batch, rngs):
    return next_token_loss(model(batch["inputs"], rngs), batch)


def test_pipelined_evaluation_runs_in_eval_mode():
    """A model with dropout: the pipelined evaluation equals the plain one (dropout off), while
    a training-mode forward gives another loss — and the blocks' dropouts, which have no rngs
    of their own under stages, would fail outside eval mode."""
    spec = PipelineSpec("blocks", pre=lambda m, b: m.dropout(m.embed(b["inputs"])),
                        post=lambda m, x, b: next_token_loss(m.head(x), b))
    tx = make_optimizer(OPT, 10)
    batch = lm_batch(batch=16)
    plain = plan_state(_DropoutLM, tx, jaxmp.make_mesh({}, one_device()))
    plain_state = init_state(plain, _DropoutLM, tx, 0)
    expected = _eval_loss(plain, plain_state, _dropout_loss, batch)
    training = float(jax.jit(make_grad_fn(plain, _dropout_loss))(
        plain_state.params, plain_state.rest, batch, jax.random.key(1))[0])
    assert abs(training - expected) > 1e-3 * abs(expected)
    split = split_layers([0.0, 1.0, 1.0, 1.0, 1.0, 1.0], 2, 2)
    mesh = jaxmp.make_mesh({"stage": 2}, jax.devices()[:2])
    layout, state = _staged(_DropoutLM, spec, split, mesh, tx)
    executor = PipelineExecutor(layout.graphdef, mesh, spec, Schedule("interleaved", 2, 4, 2),
                                split)
    got = _eval_loss(layout, state, _dropout_loss, batch, executor.eval_fn(sharding.DEFAULT_RULES))
    np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_residuals_hold_no_parameters():
    """A stashed vjp's leaves are intermediates (and the input), never the parameters; with the
    live parameters put back it gives jax.vjp's gradients."""
    params = {"w": jnp.arange(35.0).reshape(5, 7) / 35, "v": jnp.ones((7, 3))}
    x = jnp.ones((2, 5))

    def f(params, x):
        return jnp.tanh(x @ params["w"]) @ params["v"]

    def vjps(params, x):
        fn = jax.checkpoint(f, policy=stash_policy("none"))
        _, plain = jax.vjp(fn, params, x)
        _, stashed = vjp_without_params(fn, params, x)
        return plain, stashed

    plain, stashed = jax.jit(vjps)(params, x)
    param_shapes = {(5, 7), (7, 3)}
    assert param_shapes <= {a.shape for a in jax.tree.leaves(plain)}  # jax.vjp keeps them
    assert not param_shapes & {a.shape for a in jax.tree.leaves(stashed)}
    ct = jnp.ones((2, 3))
    for a, b in zip(jax.tree.leaves(plain(ct)), jax.tree.leaves(with_params(stashed, params)(ct)),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ---------------------------------------------------------------- through the Trainer

BASE = ["model.layers=4", "model.d_model=64", "model.heads=4", "train.batch_size=16",
        "data.seq_len=32", "data.source=synthetic", "logging.progress=false",
        "logging.tensorboard=false", "train.steps=3", "logging.every=1", "optimizer.eps=1e-4",
        "train.eval_every=0", "mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1"]


def _fit(run_dir, *extra, devices=None, steps=3):
    config = jaxmp.load_config(None, BASE + [f"train.steps={steps}", *extra])
    trainer = gpt_trainer(config, run_dir, devices=devices)
    trainer.fit()
    return trainer


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
    return _fit(tmp_path_factory.mktemp("plain"), "mesh.stage=1", devices=one_device())


def _plain_params(trainer) -> dict:
    return jaxmp.checkpoint.restore(trainer.run_dir, mesh=jaxmp.make_mesh({}, one_device()))


def test_three_steps_and_checkpoints_match_the_plain_run(plain_run, tmp_path):
    """stage2 x fsdp2 x tensor2, 1F1B: the same losses, and its checkpoint restores in the plain
    layout (on one device) with the plain run's values; resuming it without stages, and the
    plain checkpoint with stages, continue with identical values."""
    # 1F1B fixed: the planner's own choice here turned interleaved once the blocks kept less
    piped = _fit(tmp_path / "piped", "mesh.stage=2", "mesh.fsdp=2", "mesh.tensor=2",
                 "pipeline.schedule=1f1b", "checkpoint.async_save=false")
    assert piped.stages is not None and piped.stages.schedule.kind == "1f1b"
    np.testing.assert_allclose([h["loss"] for h in piped.history],
                               [h["loss"] for h in plain_run.history], rtol=1e-5)
    a, b = _plain_params(piped), _plain_params(plain_run)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.shape == y.shape
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)
    # exported in the plain layout too (it wrote the stages' padded stacks before stop 30)
    from safetensors.numpy import load_file
    jaxmp.checkpoint.export_safetensors(piped.run_dir, tmp_path / "p.safetensors")
    exported, restored = load_file(tmp_path / "p.safetensors"), flat_paths(a)
    assert set(exported) == set(restored)
    for k, v in exported.items():
        np.testing.assert_array_equal(v, np.asarray(restored[k]))
    # the pipelined checkpoint resumed without stages, and the plain one with 4 stages
    unpiped = _fit(tmp_path / "piped", "mesh.stage=1", devices=one_device(), steps=4)
    repiped = _fit(plain_run.run_dir, "mesh.stage=4", "mesh.data=2", steps=4)
    np.testing.assert_allclose(unpiped.history[-1]["loss"], repiped.history[-1]["loss"],
                               rtol=1e-5)


def test_the_trainer_evaluates_a_pipelined_run_forward_only(tmp_path):
    """fit() evaluates under stages with the executor's forward-only path: after one step the
    pipelined run's eval_loss is the plain run's."""
    batch = lm_batch(batch=8, seq=16)

    def eval_loss(run_dir, *extra, devices=None):
        config = jaxmp.load_config(None, BASE + [
            "model.layers=2", "train.batch_size=8", "data.seq_len=16", "train.steps=1",
            "train.eval_every=1", "train.eval_batches=1", "checkpoint.enabled=false", *extra])
        trainer = gpt_trainer(config, run_dir, devices=devices, with_data=False)
        trainer.data, trainer.eval_data = itertools.repeat(batch), lambda: [batch]
        return trainer.fit()["eval_loss"]

    plain = eval_loss(tmp_path / "plain", "mesh.stage=1", devices=one_device())
    piped = eval_loss(tmp_path / "piped", "mesh.stage=2", "pipeline.schedule=gpipe",
                      devices=jax.devices()[:2])
    np.testing.assert_allclose(piped, plain, rtol=1e-5)


def test_bad_pipeline_settings_are_one_line_errors(tmp_path):
    bad = {("mesh.stage=2", "train.microbatches=1"): "train.microbatches",
           ("mesh.stage=4", "pipeline.virtual_stages=2", "pipeline.schedule=interleaved",
            "train.microbatches=4"): "model.layers",
           ("mesh.stage=2", "train.microbatches=32"): "train.batch_size"}
    for extra, key in bad.items():
        with pytest.raises(ConfigError, match=key) as e:  # refused by the config or the plan
            config = jaxmp.load_config(None, BASE + list(extra))
            gpt_trainer(config, tmp_path, with_data=False, devices=jax.devices()[:int(
                extra[0].split("=")[1])])
        assert "\n" not in str(e.value)


def test_1f1b_and_interleaved_use_less_memory_than_gpipe(tmp_path):
    """P=4, M=8: the compiled step's temporary memory, as the schedules' in-flight counts say."""
    temp = {}
    for kind, extra in (("gpipe", []), ("1f1b", []),
                        ("interleaved", ["pipeline.virtual_stages=2"])):
        config = jaxmp.load_config(None, BASE + ["mesh.stage=4", "train.microbatches=8",
                                                 "model.layers=8", f"pipeline.schedule={kind}",
                                                 *extra])
        trainer = gpt_trainer(config, tmp_path, with_data=False, devices=jax.devices()[:4])
        temp[kind] = trainer.compile().memory_analysis().temp_size_in_bytes
    assert temp["1f1b"] < temp["gpipe"] and temp["interleaved"] < temp["gpipe"], temp


def test_gradients_cross_the_data_axis_once_per_step():
    """stage2 x data2: the data-axis reduction runs once, after the schedule — its bytes do not
    grow with the microbatches (they would, M-fold, if every chunk's backward reduced)."""
    def all_reduce_bytes(m: int) -> float:
        config = jaxmp.load_config(None, BASE + ["mesh.stage=2", "mesh.data=2", "mesh.fsdp=1",
                                                 "mesh.tensor=1", f"train.microbatches={m}"])
        trainer = gpt_trainer(config, "unused", with_data=False, devices=jax.devices()[:4])
        return collective_stats(trainer.compile()).bytes_by_kind["all-reduce"]

    two, four = all_reduce_bytes(2), all_reduce_bytes(4)
    assert two > 0 and four == pytest.approx(two, rel=0.01)
