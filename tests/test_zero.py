"""Optimizer state sharded over data (ZeRO-1, ``train.optimizer_sharding = "data"``).

The sharded step equals the plain single-device step in float32 (losses, gradient norms, params
and Adam moments after 3 steps), alone and with fsdp × tensor, microbatches (the reducer's
reduce-scatter), pipeline stages × data × tensor, a compressed reduction and the non-finite
guard; checkpoints move between on and off and across data sizes; the compiled step's argument
bytes fall as the planner predicts and its collective bytes do not change.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxmp
from jaxmp.config import OptimizerConfig
from jaxmp.hlo import collective_stats
from jaxmp.recipes.gpt import gpt_trainer
from jaxmp.sharding.optimizer import over_data
from jaxmp.train import guard as guard_mod
from jaxmp.train import zero
from jaxmp.train.guard import NonFiniteGuard
from jaxmp.train.optimizer import make_optimizer, make_schedule
from jaxmp.train.state import init_state, plan_state
from jaxmp.train.step import batch_sharding, make_train_step
from helpers import one_device
from test_guard import FINE, NAN_GRAD, NAN_LOSS, batch_with, model_fn, poisoned_loss
from jax.sharding import PartitionSpec as P

BASE = ["model.layers=4", "model.d_model=64", "model.heads=4", "train.batch_size=16",
        "data.seq_len=32", "data.source=synthetic", "logging.progress=false",
        "logging.tensorboard=false", "train.steps=3", "logging.every=1", "optimizer.eps=1e-4",
        "train.eval_every=0", "checkpoint.async_save=false", "mesh.data=1", "mesh.fsdp=1",
        "mesh.tensor=1", "mesh.stage=1"]


def _fit(run_dir, *extra, devices=None, steps=3):
    config = jaxmp.load_config(None, BASE + [f"train.steps={steps}", *extra])
    trainer = gpt_trainer(config, run_dir, devices=devices)
    trainer.fit()
    return trainer


def _state(trainer) -> dict:
    """The checkpointed state (params, Adam moments, ...) on one device, plain layout."""
    return jaxmp.checkpoint.restore(trainer.run_dir, mesh=jaxmp.make_mesh({}, one_device()),
                                    what="state")


def _close(a, b, rtol=1e-5, atol=None) -> None:
    """Leaf by leaf; ``atol`` relative to the leaf's largest value (default ``rtol``):
    elements near zero carry only summation-order noise."""
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        assert x.shape == y.shape
        scale = max(np.abs(y).max(), 1e-6)
        np.testing.assert_allclose(x, y, rtol=rtol, atol=(atol or rtol) * scale)


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return _fit(tmp_path_factory.mktemp("plain"), devices=one_device())


CASES = {
    "data8": ["mesh.data=8"],
    "data2xfsdp2xtensor2": ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"],
    "data4xtensor2-microbatches2": ["mesh.data=4", "mesh.tensor=2", "train.microbatches=2"],
    "stage2xdata2xtensor2": ["mesh.stage=2", "mesh.data=2", "mesh.tensor=2",
                             "train.microbatches=4", "pipeline.balance=layers"],
}


@pytest.mark.parametrize("case", CASES)
def test_sharded_optimizer_equals_the_plain_step(case, plain, tmp_path):
    run = _fit(tmp_path / case, *CASES[case], "train.optimizer_sharding=data")
    assert run.plan.layout.optimizer_sharding == "data"
    assert run.executed_layout() == run.plan.layout
    np.testing.assert_allclose([h["loss"] for h in run.history],
                               [h["loss"] for h in plain.history], rtol=1e-5)
    np.testing.assert_allclose([h["grad_norm"] for h in run.history],
                               [h["grad_norm"] for h in plain.history], rtol=1e-5)
    mine, ref = _state(run), _state(plain)
    _close(mine["params"], ref["params"])
    _close(mine["opt_state"], ref["opt_state"], rtol=1e-4)


def test_checkpoints_move_between_on_and_off_and_across_data_sizes(plain, tmp_path):
    """Saved sharded over data 8, resumed replicated on data 2 (and the plain checkpoint
    resumed sharded over data 8): the same values and the same fourth step."""
    sharded = _fit(tmp_path / "z", "mesh.data=8", "train.optimizer_sharding=data")
    for a, b in zip(jax.tree.leaves(_state(sharded)), jax.tree.leaves(_state(plain))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4,
                                   atol=1e-6 * max(np.abs(np.asarray(b)).max(), 1.0))
    off = _fit(tmp_path / "z", "mesh.data=2", "mesh.tensor=2", "mesh.fsdp=2",
               "train.optimizer_sharding=none", steps=4)
    on = _fit(plain.run_dir, "mesh.data=8", "train.optimizer_sharding=data", steps=4)
    assert off.executed_layout().optimizer_sharding == "none"
    assert on.executed_layout().optimizer_sharding == "data"
    np.testing.assert_allclose(off.history[-1]["loss"], on.history[-1]["loss"], rtol=1e-5)
    _close(_state(off)["params"], _state(on)["params"])


def test_compressed_reduction_with_a_sharded_optimizer(tmp_path):
    """bfloat16 gradients: the sharded optimizer changes nothing but where Adam runs."""
    extra = ("mesh.data=8", "compression.gradients=bfloat16")
    on = _fit(tmp_path / "on", *extra, "train.optimizer_sharding=data")
    off = _fit(tmp_path / "off", *extra, "train.optimizer_sharding=none")
    np.testing.assert_allclose([h["loss"] for h in on.history],
                               [h["loss"] for h in off.history], rtol=1e-6)
    # A float32 partial sum that differs in its last bit (another fusion of the same step)
    # can round to a neighbouring bfloat16 (0.4 % apart): a few elements carry that.
    a, b = _state(on), _state(off)
    _close(a["params"], b["params"], rtol=1e-5, atol=1e-3)
    _close(a["opt_state"], b["opt_state"], rtol=1e-4, atol=1e-2)


def test_compression_residuals_resume_on_another_data_size(tmp_path):
    """int8's error-feedback residuals ([data, ...], one per replica) saved on data 8 resume
    on data 4 x tensor 2 (they were refused as a model change): spread evenly with the same
    sum — the reduction sums the replicas' residuals, so that is what it still owes."""
    from jaxmp.checkpoint import records

    old = {"shape": [8, 6, 4], "dtype": "float32", "names": ["data", "embed", None]}
    new = {**old, "shape": [4, 6, 4]}
    assert records.mismatch({"r": old}, {"r": new}) is None
    assert records.mismatch({"r": old}, {"r": {**new, "shape": [4, 6, 5]}}) is not None
    x = jax.random.normal(jax.random.key(0), (8, 6, 4))
    moved = np.asarray(records.convert(x, old, new, jax.sharding.SingleDeviceSharding(
        jax.devices()[0])))
    assert moved.shape == (4, 6, 4) and (moved == moved[:1]).all()
    np.testing.assert_allclose(moved.sum(0), np.asarray(x).sum(0), rtol=1e-5, atol=1e-6)
    extra = ("compression.gradients=int8", "model.layers=2")
    _fit(tmp_path, *extra, "mesh.data=8", steps=1)
    back = _fit(tmp_path, *extra, "mesh.data=4", "mesh.tensor=2", steps=2)
    assert int(back.state.step) == 2 and np.isfinite(back.history[-1]["loss"])


# ---------------------------------------------------------------- the step, guarded

def _guarded(sharded: bool):
    mesh = jaxmp.make_mesh({"data": 4, "tensor": 2})
    opt = OptimizerConfig(lr=1e-2, warmup_steps=1)
    tx, sched = make_optimizer(opt, 20), make_schedule(opt, 20)
    g = NonFiniteGuard(3)
    layout = plan_state(model_fn, tx, mesh, extensions={guard_mod.KEY: g.extension})
    if sharded:
        layout = zero.shard_state(layout)
    state = init_state(layout, model_fn, tx, seed=0)
    example = batch_with(FINE)
    step = make_train_step(layout, poisoned_loss, tx, sched, example, guard=g,
                           zero=zero.ShardedUpdate.of(layout) if sharded else None)
    shard = batch_sharding(layout, jaxmp.rules.DEFAULT_RULES, example)
    return state, step, lambda b: jax.device_put(b, shard)


def test_the_guard_skips_non_finite_steps_with_a_sharded_optimizer():
    (a, step_a, put), (b, step_b, _) = _guarded(False), _guarded(True)
    assert zero.built(jax.tree.map(lambda x: x, _guarded_layout())) == "data"
    for i, kind in enumerate((FINE, NAN_LOSS, FINE, NAN_GRAD, FINE)):
        batch = put(batch_with(kind, i))
        a, ma = step_a(a, batch)
        b, mb = step_b(b, batch)
        assert int(ma["skipped_steps"]) == int(mb["skipped_steps"])
    assert int(mb["skipped_steps"]) == 2
    for part in ("params", "opt_state"):
        _close(getattr(b, part), getattr(a, part), rtol=1e-6)


def _guarded_layout():
    tx = make_optimizer(OptimizerConfig(), 20)
    return zero.shard_state(plan_state(model_fn, tx, jaxmp.make_mesh({"data": 4,
                                                                      "tensor": 2})))


def test_over_data_cuts_the_largest_local_dim_innermost():
    sizes = {"data": 4, "stage": 1, "fsdp": 2, "tensor": 2}
    assert over_data(P("fsdp", "tensor"), (64, 256), sizes) == P("fsdp", ("tensor", "data"))
    assert over_data(P(None, "fsdp"), (256, 16), sizes) == P("data", "fsdp")
    assert over_data(P(), (3,), sizes) == P()  # nothing divides: stays replicated
    assert over_data(P("data"), (64,), sizes) == P("data")  # already over data
    assert over_data(P(), (64,), {**sizes, "data": 1}) == P()


# ---------------------------------------------------------------- compiled bytes

GPT = ["model.layers=2", "model.d_model=64", "model.heads=8", "model.mlp_dim=256",
       "model.vocab_size=256", "model.tie_embeddings=false", "data.seq_len=16",
       "train.batch_size=16", "checkpoint.enabled=false"]


@pytest.mark.parametrize("mesh", [["mesh.data=8"], ["mesh.data=4", "mesh.tensor=2",
                                                   "train.sequence_parallel=true"],
                                  ["mesh.data=8", "train.microbatches=2"]],
                         ids=["data8", "data4xtensor2", "data8-microbatches2"])
def test_argument_bytes_fall_as_predicted_and_collective_bytes_stay(mesh):
    out = {}
    for z in ("none", "data"):
        # with sequence parallelism: the head's weight gradient stays on its vocabulary slice
        # (GPT.logits; before, 634,822 -> 700,466 B, docs/benchmarks.md)
        t = gpt_trainer(jaxmp.load_config(None, GPT + mesh + [f"train.optimizer_sharding={z}"]),
                        "unused", with_data=False)
        assert t.executed_layout() == t.plan.layout
        c = t.compile()
        stats = collective_stats(c)
        out[z] = (c.memory_analysis().argument_size_in_bytes, t.plan.predicted.argument_bytes,
                  stats.total_bytes, stats.bytes_by_kind)
    (arg0, pred0, coll0, kinds0), (arg1, pred1, coll1, kinds1) = out["none"], out["data"]
    # the gradients' all-reduce became a reduce-scatter, and the params are all-gathered
    assert kinds1["reduce-scatter"] > kinds0["reduce-scatter"]
    assert kinds1["all-gather"] > kinds0["all-gather"]
    assert kinds1["all-reduce"] < kinds0["all-reduce"]
    assert arg1 <= 0.6 * arg0
    assert abs((arg0 - arg1) - (pred0 - pred1)) <= 0.1 * (pred0 - pred1)
    assert abs(coll1 - coll0) <= 0.02 * coll0


# ---------------------------------------------------------------- the planner

def test_auto_shards_the_optimizer_state_only_when_the_replicated_one_does_not_fit():
    from jaxmp.devices import DeviceProfile
    from jaxmp.plan import plan
    from jaxmp.recipes.gpt import gpt_costs

    cost = gpt_costs(jaxmp.load_config(None, GPT))
    cpu = DeviceProfile("tiny", 1e12, 64 * 2**30, 1e11, 1e10, devices_per_host=8,
                        usable_fraction=1.0)
    roomy = plan(cost, 8, cpu, fixed={"data": 8})
    assert roomy.layout.optimizer_sharding == "none"
    replicated = roomy.predicted
    sharded = plan(cost, 8, cpu, fixed={"data": 8}, optimizer_sharding="data").predicted
    assert sharded.optimizer_bytes == pytest.approx(replicated.optimizer_bytes / 8)
    assert sharded.comm_bytes["data"] == pytest.approx(replicated.comm_bytes["data"])
    tight = DeviceProfile("tiny", 1e12, (sharded.per_device_bytes +
                                         replicated.per_device_bytes) / 2, 1e11, 1e10,
                          devices_per_host=8, usable_fraction=1.0)
    p = plan(cost, 8, tight, fixed={"data": 8})
    assert p.fits and p.layout.optimizer_sharding == "data" and "optimizer over data" in \
        p.describe()
    # configured "none": nothing fits, and the plan names the setting that would
    p = plan(cost, 8, tight, fixed={"data": 8}, optimizer_sharding="none")
    assert not p.fits and p.layout.optimizer_sharding == "none"
    assert any("set train.optimizer_sharding='data'" in n for n in p.notes), p.notes
    assert p.devices_needed is None


def test_the_nemo_175b_layout_sheds_three_quarters_of_its_adam_state():
    """NeMo's GPT-3 175B layout (data 4) with float32 params: the moments divide by 4,
    nothing else changes — bytes on the wire included (the published row runs bf16 params
    with a float32 master, sharded too: tests/test_master.py, jaxmp/train/master.py)."""
    from jaxmp.recipes.gpt import gpt_plan
    from jaxmp.recipes.published import PUBLISHED_ZERO, run_config

    run = next(r for r in PUBLISHED_ZERO if "175B" in r.name)
    config = jaxmp.config.replace(run_config(run, layout=True),
                                  model={"param_dtype": "float32"})
    on = gpt_plan(config, run.devices, run.device, strict=True, find_devices_needed=False)
    off = gpt_plan(jaxmp.config.replace(config, train={"optimizer_sharding": "none"}),
                   run.devices, run.device, strict=True, find_devices_needed=False)
    assert on.layout.optimizer_sharding == "data" and off.layout.optimizer_sharding == "none"
    d, a, b = on.mesh["data"], on.predicted, off.predicted
    assert a.optimizer_bytes == pytest.approx(b.optimizer_bytes / d)
    assert b.per_device_bytes - a.per_device_bytes == pytest.approx(
        b.optimizer_bytes * (d - 1) / d)
    assert a.comm_bytes["data"] == pytest.approx(b.comm_bytes["data"])


def test_nothing_fitting_under_fixed_settings_names_the_setting_that_would():
    """GPT-3 175B on 1024 H100 with model.remat fixed at "none", sequence parallelism off and
    no pipeline: no device count helps; the plan says which setting makes a plan fit, and that
    plan. (With sequence parallelism left at "auto" a remat-none plan fits: tensor 16 divides
    the activations enough; so does one with stages, whose stash under remat "none" keeps only
    the matmuls' outputs since stop 26, jaxmp.remat.stash_keeps.)"""
    from jaxmp.config import REMAT_POLICY_NAMES
    from jaxmp.recipes.gpt import gpt_plan
    from jaxmp.recipes.published import GPT3_175B

    config = jaxmp.load_config(None, [*GPT3_175B, "model.remat=none",
                                      "train.sequence_parallel=false", "mesh.stage=1"])
    p = gpt_plan(config, 1024, "H100", remats=REMAT_POLICY_NAMES, strict=True)
    assert not p.fits and p.devices_needed is None
    assert not any("nothing fits even on" in n for n in p.notes)
    fix = [n for n in p.notes if n.startswith("nothing runnable fits")]
    assert fix and "set model.remat=" in fix[0] and "fits at" in fix[0], p.notes


def test_a_fixed_mesh_axis_is_named_when_only_changing_it_makes_a_plan_fit():
    """1B-wide float32 at seq 2048, batch 1024, with mesh.tensor=8, remat none and one
    microbatch fixed: no remat or microbatch count fits at tensor 8 and no device count helps
    the user's mesh; the plan names the mesh axes to change with the rest (stop 30: it named a
    device count at tensor 1, which the user's fixed tensor ruled out). Stop 31: at seq 4096 /
    batch 512 (stop 30's case) no mesh change fits any more — the tensor-1 layout it named
    compiles to 107.22 GiB on deviceless H100s, now predicted 70.77 (XLA attention's backward
    holds its score arrays together) — so the case moved to seq 2048."""
    from jaxmp.config import REMAT_POLICY_NAMES
    from jaxmp.recipes.gpt import gpt_plan

    config = jaxmp.load_config("configs/gpt-1b.toml", [
        "model.compute_dtype=float32", "data.seq_len=2048", "model.layers=4",
        "train.batch_size=1024", "mesh.tensor=8", "model.remat=none", "train.microbatches=1"])
    p = gpt_plan(config, 8, "H100", remats=REMAT_POLICY_NAMES, strict=True)
    assert not p.fits and p.layout.sizes["tensor"] == 8
    fix = [n for n in p.notes if n.startswith("nothing runnable fits")]
    assert fix and "mesh.tensor=" in fix[0] and "fits at" in fix[0], p.notes
    assert not any("would be needed" in n for n in p.notes)


# ---------------------------------------------------------------- XLA's GPU compiler

@pytest.mark.filterwarnings("ignore:Error reading persistent compilation cache entry")
def test_gpu_compiled_step_shards_the_adam_state_as_predicted():
    """8 deviceless H100s, data 8 (bf16 compute, float32 params): the argument bytes fall as
    the planner predicts (±10 %) and the GPU program reduce-scatters the gradients and
    all-gathers the params."""
    from jaxmp._util.env import cuda_plugin_installed

    if not cuda_plugin_installed():
        pytest.skip('JAX\'s CUDA plugin is not installed: pip install -e ".[cuda]"')
    from jaxmp.recipes.gpt import gpt_plan
    from jaxmp.tools.measure import measure_step
    from jaxmp.topology import gpu_topology, without_persistent_cache

    without_persistent_cache()
    topo = gpu_topology(8, "H100")
    out = {}
    for z in ("none", "data"):
        config = jaxmp.load_config(None, GPT + ["mesh.data=8", "model.compute_dtype=bfloat16",
                                                "model.d_model=256", "model.mlp_dim=1024",
                                                f"train.optimizer_sharding={z}"])
        plan = gpt_plan(config, 8, device_kind="H100", platform="cuda")
        t = gpt_trainer(config, devices=list(topo.devices), with_data=False, plan=plan)
        m = measure_step(t)
        out[z] = (m.argument_bytes, plan.predicted.argument_bytes, collective_stats(m.compiled))
    (arg0, pred0, _), (arg1, pred1, stats) = out["none"], out["data"]
    assert abs((arg0 - arg1) - (pred0 - pred1)) <= 0.1 * (pred0 - pred1)
    assert stats.count_by_kind["reduce-scatter"] and stats.count_by_kind["all-gather"]


class _Odd(nnx.Module):
    """No dim any data size above 1 here divides (3 x 5, 5): nothing to cut over data."""

    def __init__(self, rngs):
        self.lin = nnx.Linear(3, 5, rngs=rngs)

    def __call__(self, x):
        return self.lin(x)


def _odd_loss(model, batch):
    return jnp.mean(model(batch["x"]) ** 2)


def test_a_model_with_nothing_data_divides_plans_what_it_builds():
    """Sharding the optimizer over data cuts nothing in this model: with costs the planner
    predicts "none" (what the Trainer builds), asked or auto; without costs an explicit
    "data" is refused with one line naming the key."""
    from jaxmp import Trainer, TrainerConfig
    from jaxmp.errors import ConfigError

    batch = {"x": jax.ShapeDtypeStruct((8, 3), jnp.float32)}
    for asked in ("data", "auto"):
        config = jaxmp.load_config(None, ["mesh.data=8", f"train.optimizer_sharding={asked}"],
                                   schema=TrainerConfig)
        t = Trainer(config, _Odd, _odd_loss, None, example_batch=batch)
        assert t.plan.layout.optimizer_sharding == "none"
        assert t.executed_layout().optimizer_sharding == "none"
    config = jaxmp.load_config(None, ["mesh.data=8", "train.optimizer_sharding=data"],
                               schema=TrainerConfig)
    with pytest.raises(ConfigError, match="train.optimizer_sharding='data'"):
        Trainer(config, _Odd, _odd_loss, None)
