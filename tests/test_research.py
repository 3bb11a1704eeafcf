"""Research code trains as written: examples/train_research_lm.py's lm1b-style model — stock Flax
NNX layers, ``nnx.with_partitioning`` in its own names (two names on 3-D attention kernels),
dropout with model-held ``nnx.Rngs`` and per-step ``rngs`` at call time — through jaxmp.Trainer
with no workaround: it builds, shards, equals one device, trains, resumes bitwise, restores.
"""
from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from flax import nnx

import jaxmp
from jaxmp import rules
from jaxmp.checkpoint.records import flat_paths
from jaxmp.hlo import collective_stats
from jaxmp.plan import make_plan
from jaxmp.plan.shard import resolve_shard
from jaxmp.train.planning import CostSource
from helpers import Recorder

QUIET = ["checkpoint.enabled=false", "logging.progress=false", "logging.tensorboard=false",
         "logging.every=1", "optimizer.eps=1e-4"]


@pytest.fixture(scope="module")
def lm():
    import train_research_lm

    return train_research_lm


def _example(lm, rows: int = 16):
    return {k: jax.ShapeDtypeStruct((rows, 64), np.int32) for k in ("inputs", "targets")}


def _batch(rows: int = 16, seq: int = 64, seed: int = 0) -> dict:
    tokens = np.random.default_rng(seed).integers(0, 256, (rows, seq + 1), dtype=np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def _trainer(lm, mesh: dict, devices=None, steps: int = 3, run_dir="/tmp/unused", extra=()):
    axes = [f"mesh.{a}={mesh.get(a, 1)}" for a in ("data", "stage", "fsdp", "tensor")]
    config = lm.make_config(steps, [*axes, *QUIET, *extra])
    return lm.make_trainer(config, str(run_dir), devices=devices)


def test_lint_on_fsdp8_splits_every_matrix(lm):
    model = rules.abstract(lambda: lm.TransformerLM(nnx.Rngs(0)))
    report = rules.lint(model, jaxmp.make_mesh({"fsdp": 8}), rules=lm.RULES)
    matrices = [a for a in report.arrays if a.path.endswith(("kernel", "embedding"))]
    assert all(a.per_device_bytes * 8 == a.nbytes for a in matrices), [
        (a.path, a.spec) for a in matrices if a.per_device_bytes * 8 != a.nbytes]
    assert report.shard_ratio <= 1.1
    # the 3-D attention kernels carry two names: padded, and lint says so
    assert ("blocks/0/attn/query/kernel", 2, 3) in report.partial


def test_mesh_axis_names_in_metadata_shard(lm):
    """The same model annotated with mesh-axis names (Flax's MeshRules style) shards on fsdp=8
    instead of being read as unknown names and replicated."""
    model = rules.abstract(lambda: lm.TransformerLM(nnx.Rngs(0), names=lm.MESH_AXES))
    report = rules.lint(model, jaxmp.make_mesh({"fsdp": 8}))
    assert report.shard_ratio <= 1.1 and report.unknown_names == []
    specs = jax.tree.leaves(rules.specs_for(model, jaxmp.make_mesh({"fsdp": 4, "tensor": 2})),
                            is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    assert jax.sharding.PartitionSpec("fsdp", "tensor") in specs


def test_lint_names_the_out_bias_split_over_tensor(lm):
    """nnx.MultiHeadAttention hands its one bias_init to the out projection too: the out bias
    ([embed]) is named "kv" like the q/k/v biases, RULES split it over tensor while its kernel
    leaves embed whole, and XLA keeps the residual split (Stop 32). Lint names it in one line;
    biases named after their kernel (up, down) and fsdp-split ones (gathered) are not flagged."""
    model = rules.abstract(lambda: lm.TransformerLM(nnx.Rngs(0)))
    report = rules.lint(model, jaxmp.make_mesh({"tensor": 8}), rules=lm.RULES)
    assert [b.path for b in report.split_biases] == [f"blocks/{i}/attn/out/bias" for i in (0, 1)]
    assert report.split_biases[0].mesh_axes == ("tensor",)
    assert "blocks/0/attn/out/bias is split over tensor on dim 0 by rule ('kv' -> tensor)" \
        in report.warning()
    assert rules.lint(model, jaxmp.make_mesh({"fsdp": 8}), rules=lm.RULES).warning() is None


@pytest.fixture(scope="module")
def one_device_step(lm):
    t = _trainer(lm, {}, devices=jax.devices()[:1])
    return _grads(t)


def _grads(trainer) -> tuple:
    """Loss and gradients of step 0 (dropout on, keys from the seed and the step)."""
    from jaxmp.train.state import init_state
    from jaxmp.train.step import batch_sharding, make_grad_fn, step_key

    state = init_state(trainer.layout, trainer.model_fn, trainer.tx, 0)
    batch = _batch()
    gbatch = jax.device_put(batch, batch_sharding(trainer.layout, trainer.rules, batch))
    grad_fn = jax.jit(make_grad_fn(trainer.layout, trainer.loss_fn, 1, trainer.rules))
    loss, grads, _, _ = grad_fn(state.params, state.rest, gbatch, step_key(0, state.step))
    return float(loss), [np.asarray(g) for g in jax.tree.leaves(grads)]


def test_d2f2t2_step_equals_one_device(lm, one_device_step, capfd):
    """Including dropout: the per-step keys give the same masks on any mesh. The batch pinning
    at layer boundaries leaves XLA no reason for an involuntary full rematerialization."""
    t = _trainer(lm, {"data": 2, "fsdp": 2, "tensor": 2})
    loss, grads = _grads(t)
    ref_loss, ref_grads = one_device_step
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    for g, r in zip(grads, ref_grads, strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-7 * max(1.0, np.abs(r).max()))
    t.compile(_example(lm))
    assert "Involuntary full rematerialization" not in capfd.readouterr().err


def test_sequence_parallel_without_a_seq_name_is_refused_not_claimed(lm):
    """train.sequence_parallel=true on a model planned without costs whose activations never
    name ``seq`` (the example constrains none): its step would be the plain one while the
    executed layout said sequence parallel — refused when the step is traced."""
    t = _trainer(lm, {"data": 2, "tensor": 4}, extra=["train.sequence_parallel=true"])
    with pytest.raises(jaxmp.errors.ConfigError, match="names no activation's sequence dim"):
        t.compile(_example(lm))


def test_per_step_randomness_is_fresh_and_reproducible(lm):
    from jaxmp.train.state import init_state
    from jaxmp.train.step import batch_sharding, make_grad_fn, step_key

    t = _trainer(lm, {"fsdp": 8})
    state = init_state(t.layout, t.model_fn, t.tx, 0)
    batch = jax.device_put(_batch(), batch_sharding(t.layout, t.rules, _batch()))
    grad_fn = jax.jit(make_grad_fn(t.layout, t.loss_fn, 1, t.rules))
    losses = [float(grad_fn(state.params, state.rest, batch, step_key(0, s))[0])
              for s in (0, 1, 0)]
    assert losses[0] == losses[2] and losses[0] != losses[1]


def test_trains_resumes_bitwise_and_restores(lm, tmp_path):
    """30 steps on fsdp4×tensor2 lower the loss; preempted at step 15 and restarted, the run is
    bitwise the uninterrupted one (dropout keys included); its checkpoint restores every param
    on fsdp8."""
    mesh = {"fsdp": 4, "tensor": 2}
    straight = _trainer(lm, mesh, steps=30, run_dir=tmp_path / "a", extra=["checkpoint.enabled=true"])
    straight.fit()
    losses = [r["loss"] for r in straight.history]
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 1.0, losses
    first = _trainer(lm, mesh, steps=30, run_dir=tmp_path / "b", extra=["checkpoint.enabled=true"])
    first.data = Recorder(first.data, signal_at=15)  # a SIGTERM arrives at batch 15
    first.fit()
    stopped = int(first.state.step)
    assert 15 <= stopped < 30
    resumed = _trainer(lm, mesh, steps=30, run_dir=tmp_path / "b", extra=["checkpoint.enabled=true"])
    resumed.fit()
    assert [r["loss"] for r in resumed.history] == losses[stopped:]
    a = jaxmp.checkpoint.digest(straight.state)
    assert a == jaxmp.checkpoint.digest(resumed.state)
    assert any(p.startswith("rest/") for p in a)  # the model-held RNG streams too
    params = jaxmp.checkpoint.restore(tmp_path / "a", mesh=jaxmp.make_mesh({"fsdp": 8}))
    want = {p.removeprefix("params/") for p in a if p.startswith("params/")}
    assert set(flat_paths(params)) == want
    lint = json.loads((tmp_path / "a" / "plan.json").read_text())["lint"]
    assert lint["unknown_names"] == []


def test_rules_replace_the_defaults_in_the_trainer(lm):
    """rules= is the complete list everywhere: without "kv" the kv kernels replicate, and a
    list of only our own rules leaves the default names unsharded."""
    t = lm.make_trainer(lm.make_config(1, ["mesh.fsdp=8", "mesh.tensor=1", *QUIET]), "/tmp/x")
    assert t.rules == rules.normalize_rules(lm.RULES)
    only = jaxmp.Trainer(t.config, t.model_fn, t.loss_fn, None, rules=[("kv", "tensor")])
    assert only.lint().replicated_bytes == only.lint().total_bytes


def test_path_rules_reach_the_planner():
    """A model named only by path rules is costed and planned sharded, not replicated."""
    import train_custom as tc

    config = jaxmp.load_config(None, ["train.batch_size=32"], schema=jaxmp.TrainerConfig)
    example = {"images": jax.ShapeDtypeStruct((32, *tc.IMAGE), np.float32),
               "labels": jax.ShapeDtypeStruct((32,), np.int32)}

    def model_fn(rngs):
        return tc.ConvNet(rngs=rngs)

    named = make_plan(config, CostSource(model_fn, tc.classification_loss, example_batch=example,
                                         path_rules=tc.PATH_RULES).get(), 8, rules=tc.RULES)
    bare = make_plan(config, CostSource(model_fn, tc.classification_loss,
                                        example_batch=example).get(), 8, rules=tc.RULES)
    assert named.param_specs["conv2/kernel"] != [] and bare.param_specs["conv2/kernel"] == []


@pytest.fixture(scope="module")
def cost(lm):
    return CostSource(lambda r: lm.TransformerLM(r), lm.lm_loss,
                      example_batch=_example(lm)).get()


def test_the_planner_costs_a_model_whose_loss_takes_rngs(lm, cost):
    """Dropout with the Trainer's per-step ``rngs`` puts PRNG-key arrays (an extended dtype
    numpy cannot read) in the traced step: the cost model sizes them like any array, so a
    mesh left on "auto" is planned from the model's own costs instead of crashing."""
    config = lm.make_config(1, ["mesh.data=auto", "mesh.fsdp=auto", "mesh.tensor=auto",
                                *QUIET])
    plan = make_plan(config, cost, 8, rules=lm.RULES)
    assert plan.fits and plan.predicted.per_device_bytes > 0


def test_tensor_parallelism_counts_the_block_matrices_not_its_biases(lm, cost):
    """nnx.MultiHeadAttention's (heads, head_dim) biases, split over tensor by their one name
    ("kv"), are no row-parallel matrices: a block has 6 tensor-split matrices (query, key,
    value, up: columns; out, down: rows), as Megatron counts; the planner charged 9 and 5."""
    block = next(i for i, lay in enumerate(cost.layers) if lay.name == "blocks/0")
    shard = resolve_shard(cost.layers[block], 2, 2, rules.normalize_rules(lm.RULES),
                          "param", "param", None, True)
    assert (shard.tensor_weights, shard.row_parallel) == (6, 2)


def test_fsdp8_collective_bytes_against_zero3(lm):
    """What the research model sends per step under fsdp=8 (docs/benchmarks.md): within
    ZeRO-3's 3(N−1)/N·P (XLA keeps straight-line layers' gathered weights for the backward)."""
    t = _trainer(lm, {"fsdp": 8})
    stats = collective_stats(t.compile(_example(lm)))
    p = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(t.layout.abstract.params))
    assert stats.total_bytes <= 3 * 7 / 8 * p
    assert stats.bytes_by_kind["all-gather"] >= 0.9 * 7 / 8 * p  # the weights are gathered


def test_tensor_bytes_are_the_activation_not_the_mask(lm, cost):
    """The block's all-reduces move the residual stream: the float32 causal mask it is also
    handed (``nnx.make_causal_mask``, [rows, 1, seq, seq]) carries no gradient and is no part
    of them. Counting it put data 2 x fsdp 2 x tensor 2 at +22 % (4.05 / 3.31 MB); now +0.4 %."""
    block = next(lay for lay in cost.layers if lay.name == "blocks/0")
    assert block.input_bytes == 16 * 64 * 128 * 4  # x only (the mask adds half again)
    mesh = {"data": 2, "fsdp": 2, "tensor": 2}
    t = _trainer(lm, mesh)
    plan = make_plan(t.config, cost, 8, rules=lm.RULES)
    compiled = collective_stats(t.compile(_example(lm))).total_bytes
    assert plan.predicted.comm_bytes_per_step == pytest.approx(compiled, rel=0.05)
