"""Sequence parallelism (``train.sequence_parallel``): the residual stream's sequence sharded
over ``tensor`` by the rules alone. The step equals the plain one-device step in float32 (loss,
gradients, params after 3 steps) alone and with stage x data x tensor; a research model that
names its activations gets it too; the planner decides and predicts it; the compiled program's
temporary bytes fall as predicted while its collective bytes stay."""
from __future__ import annotations

import contextlib
import dataclasses
import io
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxmp
from jaxmp import rules as R
from jaxmp._util.env import cuda_plugin_installed
from jaxmp.checkpoint.records import to_plain
from jaxmp.errors import ConfigError
from jaxmp.hlo import collective_overlap, collective_stats
from jaxmp.models import lm_loss
from jaxmp.devices import PROFILES
from jaxmp.plan.predict import RING_SENDS_PER_BLOCK, RING_STEP_LATENCY_S
from jaxmp.plan.context import Context
from jaxmp.plan.sequence import choices
from jaxmp.recipes.gpt import gpt_costs, gpt_plan, gpt_trainer
from jaxmp.recipes.published import GPT3_175B
from jaxmp.sharding import ring
from jaxmp.tools.measure import measure_step
from jaxmp.topology import gpu_topology
from jaxmp.train.state import init_state
from jaxmp.train.step import batch_sharding, make_grad_fn
from helpers import lm_batch, one_device

BASE = ["model.layers=4", "model.d_model=64", "model.heads=4", "model.vocab_size=128",
        "train.batch_size=16", "data.seq_len=32", "data.source=synthetic",
        "optimizer.eps=1e-4", "optimizer.warmup_steps=1", "optimizer.lr=1e-3"]
AXES = ("data", "stage", "fsdp", "tensor")


# ---------------------------------------------------------------- the rules


def test_only_the_residual_stream_takes_tensor_on_its_sequence():
    """First free match: heads, mlp and vocab keep tensor; only [batch, seq, embed] shards
    its sequence; parameters and the plain rules are untouched."""
    sp = R.sequence_parallel_rules(R.DEFAULT_RULES)
    assert R.sequence_parallel_rules(sp) == sp
    mesh = {"data": 2, "stage": 1, "fsdp": 1, "tensor": 4}
    spec = lambda names, shape, rules=sp: R.resolve(names, shape, mesh, rules).spec
    P = jax.sharding.PartitionSpec
    assert spec(("batch", "seq", "act_embed"), (8, 32, 64)) == P("data", "tensor")
    assert spec(("batch", "seq", "act_embed"), (8, 32, 64), R.DEFAULT_RULES) == P("data")
    assert spec(("batch", "seq", "act_heads", None), (8, 32, 4, 16)) == P("data", None, "tensor")
    assert spec(("batch", "seq", "act_mlp"), (8, 32, 256)) == P("data", None, "tensor")
    assert spec(("batch", "seq", "act_vocab"), (8, 32, 128)) == P("data", None, "tensor")
    assert spec(("embed", "mlp"), (64, 256)) == spec(("embed", "mlp"), (64, 256), R.DEFAULT_RULES)
    assert R.shards_sequence(sp, mesh) and not R.shards_sequence(R.DEFAULT_RULES, mesh)
    assert not R.shards_sequence(sp, {**mesh, "tensor": 1})


# ---------------------------------------------------------------- equivalence, through the Trainer


def _trainer(*sets, devices=None):
    config = jaxmp.load_config(None, BASE + list(sets))
    return gpt_trainer(config, devices=devices or jax.devices()[:8], with_data=False)


def _three_steps(trainer):
    """(loss, grads, params after 3 steps, losses) with the Trainer's own step; pipelined
    stacks back in the plain layer order."""
    batch = lm_batch(batch=16, seq=32, vocab=128)
    layout = trainer.layout
    gbatch = jax.device_put(batch, batch_sharding(layout, trainer.step_rules, batch))
    state = init_state(layout, trainer.model_fn, trainer.tx, 0)
    # the Trainer's own gradient runs inside its per-replica reducer: take the same function
    # with the data axis, as a plain jit can call it
    grad_fn = trainer.executor.grad_fn(trainer.step_rules) if trainer.executor else \
        make_grad_fn(layout, lm_loss, 1, trainer.step_rules)
    loss, grads, _, _ = jax.jit(grad_fn)(state.params, state.rest, gbatch)
    step, losses = trainer.compile(gbatch), []
    for _ in range(3):
        state, m = step(state, gbatch)
        losses.append(float(m["loss"]))
    plain = (lambda t: t) if trainer.stages is None else _unstage(trainer.stages.split)
    return float(loss), plain(grads), plain(state.params), losses


def _unstage(split):
    index = split.flat_index()

    def plain(tree):
        out = dict(_pure(tree))
        out["blocks"] = jax.tree.map(lambda a: to_plain(a, index), out["blocks"])
        return out

    return plain


def _pure(tree):
    return nnx.to_pure_dict(tree) if isinstance(tree, nnx.State) else tree


def _saved_bytes(*sets):
    """Bytes of the residuals the gradient keeps (per shard_map-local shape) for the loss."""
    trainer = _trainer(*sets)
    layout = trainer.layout
    state = init_state(layout, trainer.model_fn, trainer.tx, 0)
    batch = lm_batch(batch=16, seq=32, vocab=128)

    def loss(params):
        model = nnx.merge(layout.graphdef, params, state.rest, copy=True)
        with jaxmp.sharding.activation_sharding(layout.mesh, trainer.step_rules):
            return lm_loss(model, batch)[0]

    out = io.StringIO()
    with contextlib.redirect_stdout(out):  # one line per residual: "f32[1,16,32,64] output of"
        jax.ad_checkpoint.print_saved_residuals(loss, state.params)
    kept = [re.match(r"(\w+)\[([\d,]*)\]", line).groups()
            for line in out.getvalue().splitlines() if line and "argument" not in line]
    return sum(max(1, int(re.sub(r"\D", "", d) or 8) // 8)  # f32: 4 bytes, bool: 1
               * int(np.prod([int(n) for n in s.split(",") if n])) for d, s in kept)


def test_rings_keep_what_the_plain_projections_keep():
    """Under save_dots the rings' backward keeps what sequence parallelism's does: the row
    side's output is a sum of per-block products, which ``save_dots`` saves by name
    (jaxmp.remat); without it every block's product was kept and the ring's sends re-run in
    the backward (Llama-3-70B's width: 7 more [rows, seq/t, d_model] per layer, stop 30)."""
    sets = ["mesh.data=2", "mesh.stage=1", "mesh.fsdp=1", "mesh.tensor=4", "model.layers=1",
            "train.sequence_parallel=true", "model.remat=save_dots", "train.microbatches=1"]
    assert _saved_bytes(*sets, "model.collective_matmul=true") == \
        _saved_bytes(*sets, "model.collective_matmul=false")


@pytest.fixture(scope="module")
def reference():
    return _three_steps(_trainer("mesh.data=1", "mesh.stage=1", "mesh.fsdp=1", "mesh.tensor=1",
                                 "train.sequence_parallel=false", devices=one_device()))


@pytest.mark.parametrize("axes,microbatches,extra", [
    ((2, 1, 1, 4), "auto", ()), ((2, 2, 1, 2), "auto", ()), ((2, 1, 1, 4), 2, ()),
    ((2, 1, 1, 4), "auto", ("model.collective_matmul=true",)),
    ((2, 1, 1, 4), 2, ("model.collective_matmul=true", "train.optimizer_sharding=data"))],
    ids=["data2xtensor4", "stage2xdata2xtensor2", "data2xtensor4x2mb", "ring-data2xtensor4",
         "ring-data2xtensor4x2mb-zero"])
def test_sequence_parallel_step_equals_one_device(axes, microbatches, extra, reference):
    """...and inside the gradient-accumulation loop (microbatches carried: train/step.py), and
    with the projections as ring collective matmuls (``model.collective_matmul``, which
    "auto" turns on only on GPUs: jaxmp.sharding.ring), also inside the reducer's shard_map
    over data (optimizer state sharded over data)."""
    trainer = _equals_reference(axes, microbatches, extra, reference)
    assert trainer.plan.layout.sequence_parallel
    assert trainer.executed_layout() == trainer.plan.layout


@pytest.mark.parametrize("axes", [(2, 2, 1, 2), (2, 1, 1, 4)],
                         ids=["stage2xdata2xtensor2", "data2xtensor4"])
def test_gpu_program_gathering_once_equals_one_device(axes, reference, monkeypatch):
    """The GPU meshes' program, forced here: the split stream gathered once for q, k and v
    and a row matmul's output gradient once for both its products
    (jaxmp.sharding.ring.gathered_once), in pipeline stages and out."""
    monkeypatch.setattr(ring, "GPU_PLATFORMS", (*ring.GPU_PLATFORMS, "cpu"))
    gathered, once = [], ring._once

    def recorded(x, names):
        gathered.append(once(x, names))
        return gathered[-1]

    monkeypatch.setattr(ring, "_once", recorded)
    trainer = _equals_reference(axes, "auto", (), reference)
    assert trainer.plan.layout.sequence_parallel
    assert trainer.executed_layout() == trainer.plan.layout
    assert any(gathered)  # the step was traced through gathered_once's gather


def _equals_reference(axes, microbatches, extra, reference):
    """The trainer for ``axes`` with sequence parallelism, after asserting its three steps
    equal the one-device reference's (loss, losses, gradients, parameters)."""
    sets = [f"mesh.{a}={n}" for a, n in zip(AXES, axes)] + [
        "train.sequence_parallel=true", f"train.microbatches={microbatches}", *extra]
    trainer = _trainer(*sets)
    ref_loss, ref_grads, ref_params, ref_losses = reference
    loss, grads, params, losses = _three_steps(trainer)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for got, ref in ((grads, ref_grads), (params, ref_params)):
        for g, r in zip(jax.tree.leaves(_pure(got)), jax.tree.leaves(_pure(ref)), strict=True):
            r = np.asarray(r)
            np.testing.assert_allclose(np.asarray(g), r, rtol=1e-5, atol=1e-5 * np.abs(r).max())
    return trainer


# ---------------------------------------------------------------- a research model


class _Research(nnx.Module):
    """Stock nnx layers, activations named the ordinary way through rules.constrain."""

    def __init__(self, rngs: nnx.Rngs, vocab: int = 128, d: int = 64):
        part = nnx.with_partitioning
        init = nnx.initializers.normal(0.02)
        self.embed = nnx.Embed(vocab, d, embedding_init=part(init, ("vocab", "embed")),
                               rngs=rngs)
        self.norm = nnx.LayerNorm(d, scale_init=part(nnx.initializers.ones, ("norm",)),
                                  use_bias=False, rngs=rngs)
        self.up = nnx.Linear(d, 4 * d, kernel_init=part(init, ("embed", "mlp")),
                             use_bias=False, rngs=rngs)
        self.down = nnx.Linear(4 * d, d, kernel_init=part(init, ("mlp", "embed")),
                               use_bias=False, rngs=rngs)
        self.head = nnx.Linear(d, vocab, kernel_init=part(init, ("embed", "vocab")),
                               use_bias=False, rngs=rngs)

    def __call__(self, tokens):
        x = R.constrain(self.embed(tokens), ("batch", "seq", "act_embed"))
        h = R.constrain(jax.nn.gelu(self.up(self.norm(x))), ("batch", "seq", "act_mlp"))
        x = R.constrain(x + self.down(h), ("batch", "seq", "act_embed"))
        return self.head(x)


def _research_loss(model, batch):
    logits = model(batch["inputs"]).astype(jnp.float32)
    hot = jax.nn.one_hot(batch["targets"], logits.shape[-1])
    return jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.sum(logits * hot, -1))


def _research(sp, devices, tmp_path):
    batch = lm_batch(batch=8, seq=32, vocab=128)
    config = jaxmp.load_config(None, [f"mesh.data={len(devices) // min(4, len(devices))}",
                                      f"mesh.tensor={min(4, len(devices))}", "mesh.fsdp=1",
                                      "mesh.stage=1", "train.batch_size=8",
                                      f"train.sequence_parallel={str(sp).lower()}",
                                      "optimizer.eps=1e-4"], schema=jaxmp.TrainerConfig)
    return jaxmp.Trainer(config, lambda rngs: _Research(rngs), _research_loss, None,
                         devices=devices, example_batch=batch, run_dir=tmp_path), batch


def test_a_research_model_that_names_its_activations_gets_it(tmp_path):
    """A stock-nnx model on data2 x tensor4: planned with "auto", its residual stream is
    sequence-sharded in the compiled step (one reduce-scatter + all-gather pair where the plain
    step all-reduces), and its loss and gradients equal one device's."""
    on, batch = _research("auto", jax.devices()[:8], tmp_path / "on")
    assert on.plan.layout.sequence_parallel and on.executed_layout() == on.plan.layout
    off, _ = _research(False, jax.devices()[:8], tmp_path / "off")
    assert not off.executed_layout().sequence_parallel
    kinds = [{k: v for k, v in collective_stats(t.compile(batch)).count_by_kind.items() if v}
             for t in (off, on)]
    assert "reduce-scatter" not in kinds[0] and kinds[1].get("reduce-scatter", 0) >= 1
    ref, _ = _research(False, one_device(), tmp_path / "ref")
    results = []
    for t in (on, ref):
        state = init_state(t.layout, t.model_fn, t.tx, 0)
        gb = jax.device_put(batch, batch_sharding(t.layout, t.step_rules, batch))
        results.append(jax.jit(make_grad_fn(t.layout, _research_loss, 1, t.step_rules))(
            state.params, state.rest, gb))
    np.testing.assert_allclose(float(results[0][0]), float(results[1][0]), rtol=1e-6)
    for g, r in zip(jax.tree.leaves(results[0][1]), jax.tree.leaves(results[1][1]), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5,
                                   atol=1e-6 * np.abs(np.asarray(r)).max())


# ---------------------------------------------------------------- the planner


def test_auto_chooses_it_with_tensor_and_says_so():
    plan = gpt_plan(jaxmp.load_config(None, BASE + ["mesh.data=2", "mesh.tensor=4",
                                                    "mesh.stage=1", "mesh.fsdp=1"]), 8)
    assert plan.layout.sequence_parallel and "sequence parallel" in plan.describe()
    assert plan.to_json()["layout"]["sequence_parallel"] is True
    plain = gpt_plan(jaxmp.load_config(None, BASE + ["mesh.data=8"]), 8)
    assert not plain.layout.sequence_parallel  # nothing to shard without tensor
    with pytest.raises(ConfigError, match="train.sequence_parallel"):
        gpt_plan(jaxmp.load_config(None, BASE + ["mesh.tensor=8", "mesh.data=1", "mesh.stage=1",
                                                 "mesh.fsdp=1", "data.seq_len=36",
                                                 "train.sequence_parallel=true"]), 8)


def test_auto_turns_it_on_only_where_it_pays():
    """The README's example (the tiny default on 64 x H100): on GPUs sequence parallelism
    costs the backward's extra all-gathers, so the planner takes the layout without it (its
    GPU program sends 3.6 MiB as predicted; with it, data 4 x stage 2 x fsdp 2 x tensor 4,
    3.5 as predicted since stop 35, 12.2 before: docs/planner.md §7); with more
    tensor devices than heads it is never tried; on CPUs it costs nothing and is taken.
    With the ring collective matmuls (the default "auto": on GPUs) the planner charges the
    blocks' tensor collectives as hidden behind their matmuls, and each ring step a fixed
    latency: at the tiny width the steps cost more than they hide, so it stays off; at
    8192 wide it pays and is taken (docs/planner.md §4 "Overlap")."""
    for collective_matmul in ("false", "auto"):
        tiny = gpt_plan(jaxmp.load_config(None, [f"model.collective_matmul={collective_matmul}"]),
                        64, device_kind="H100", platform="cuda")
        assert not tiny.layout.sequence_parallel and tiny.layout.sizes["tensor"] > 1
    wide = ["model.layers=2", "model.d_model=8192", "model.heads=64", "model.vocab_size=32000",
            "model.compute_dtype=bfloat16", "model.param_dtype=bfloat16", "data.seq_len=4096",
            "train.batch_size=16", "mesh.tensor=8", "mesh.stage=1"]
    plain, rings = (gpt_plan(jaxmp.load_config(None, wide + [f"model.collective_matmul={c}"]),
                             64, device_kind="H100", platform="cuda") for c in ("false", "auto"))
    assert rings.layout.sequence_parallel and not plain.layout.sequence_parallel
    assert rings.predicted.step_time_s < plain.predicted.step_time_s
    assert choices("auto", 8, 128, splits_every_matrix=False) == (False,)
    assert choices("auto", 4, 128, splits_every_matrix=True) == (False, True)
    assert choices(True, 4, 128, splits_every_matrix=False) == (True,)
    wide = gpt_plan(jaxmp.load_config(None, ["mesh.tensor=8", "mesh.data=1", "mesh.stage=1",
                                             "mesh.fsdp=1"]), 8)  # 4 heads on 8 devices
    assert not wide.layout.sequence_parallel
    # the extra gathers: one per column-parallel input (a block: 2; the head: 1), per device
    sets = ["model.layers=2", "model.d_model=256", "model.heads=8", "model.vocab_size=256",
            "model.compute_dtype=bfloat16", "data.seq_len=64", "train.batch_size=8",
            "mesh.tensor=8", "mesh.data=1", "mesh.stage=1", "mesh.fsdp=1",
            "train.microbatches=1", "model.remat=none"]
    sent = [gpt_plan(jaxmp.load_config(None, sets + [f"train.sequence_parallel={sp}"]), 8,
                     device_kind="H100", platform="cuda").predicted.comm_bytes["tensor"]
            for sp in ("false", "true")]
    io = 8 * 64 * 256 * 2  # the residual stream in bf16
    assert sent[1] - sent[0] == pytest.approx((2 * 2 + 1) * 7 / 8 * io)


def test_inside_a_gpu_accumulation_loop_it_is_kept_and_predicted():
    """The accumulation loop carries its microbatch (jaxmp.train.step), so XLA's GPU pipeline
    keeps the activations sequence-sharded inside it (docs/planner.md §7): with 2
    microbatches sequence parallelism is predicted lower than without, as with one."""
    sets = ["model.layers=2", "model.d_model=256", "model.heads=8", "model.vocab_size=256",
            "model.compute_dtype=bfloat16", "data.seq_len=256", "train.batch_size=8",
            "mesh.tensor=4", "mesh.data=2", "mesh.stage=1", "mesh.fsdp=1", "model.remat=none"]

    def plan(microbatches: int, sp: str):
        return gpt_plan(jaxmp.load_config(None, sets + [f"train.microbatches={microbatches}",
                                                        f"train.sequence_parallel={sp}"]), 8,
                        device_kind="H100", platform="cuda")

    for microbatches in (1, 2):
        on, off = plan(microbatches, "true"), plan(microbatches, "false")
        assert on.layout.sequence_parallel and not off.layout.sequence_parallel
        assert on.predicted.per_device_bytes < off.predicted.per_device_bytes


def test_matmul_operands_stay_whole_in_the_backward_working_set():
    """Under sequence parallelism a block's backward still meets its matmuls with the whole
    sequence (gathered inputs, input-gradient partial sums; on GPUs also each weight
    gradient's saved input gathered again): the planner's working set counts those values
    whole, so it is far above the one without sequence parallelism divided by ``tensor``, and
    on GPUs (which gather again) above XLA:CPU's (jaxmp.cost.liveness, docs/planner.md §7)."""
    config = jaxmp.load_config(None, ["model.layers=2", "model.d_model=256", "model.heads=8",
                                      "model.vocab_size=256", "data.seq_len=256",
                                      "train.batch_size=8", "model.remat=none",
                                      "model.compute_dtype=bfloat16"])
    cost = gpt_costs(config, attention="cudnn")  # no S x S scores to dominate the peak
    block = next(i for i, lay in enumerate(cost.layers) if lay.kind == "block")
    gpu = PROFILES["H100"]
    work = {}
    for again in (True, False):  # the GPU compiler gathers them again; XLA:CPU does not
        ctx = Context(cost, dataclasses.replace(gpu, reassociates_all_reduce=again), 8)
        work[again] = [ctx._transient(block, "none", 1, 4, 8, 8 * 256 * 256 * 2, sp)
                       for sp in (False, True)]
    off, on = work[True]
    assert off / 4 * 2 < on < off
    assert work[False][1] < on and work[False][0] == off


# ---------------------------------------------------------------- compiled bytes


def test_compiled_temporaries_fall_as_predicted_and_collectives_stay():
    """data2 x tensor4, 8 layers: the compiled step's temporary bytes fall by the predicted
    amount (±10 %), its argument bytes and collective bytes stay (±2 %: the embedding lookup's
    forward all-reduce is the one collective that is not split in two)."""
    sets = ["model.layers=8", "model.d_model=128", "model.heads=8", "model.vocab_size=256",
            "train.batch_size=16", "data.seq_len=64", "mesh.data=2", "mesh.tensor=4",
            "mesh.stage=1", "mesh.fsdp=1", "train.microbatches=1"]
    rows = []
    for sp in ("false", "true"):
        config = jaxmp.load_config(None, sets + [f"train.sequence_parallel={sp}"])
        plan = gpt_plan(config, 8)
        trainer = gpt_trainer(config, devices=jax.devices()[:8], with_data=False, plan=plan)
        m, p = measure_step(trainer), plan.predicted
        rows.append((p.per_device_bytes - p.argument_bytes, m.temp_bytes, p.argument_bytes,
                     m.argument_bytes, p.comm_bytes_per_step, m.collectives.total_bytes))
    (pt0, ct0, pa0, ca0, pc0, cc0), (pt1, ct1, pa1, ca1, pc1, cc1) = rows
    assert pt1 < 0.8 * pt0
    assert (ct0 - ct1) == pytest.approx(pt0 - pt1, rel=0.10)
    assert pa1 == pa0 and ca1 == pytest.approx(ca0, rel=0.01)
    assert pc1 == pc0 and cc1 == pytest.approx(cc0, rel=0.02)


# ---------------------------------------------------------------- the GPU compiler, deviceless


@pytest.mark.skipif(not cuda_plugin_installed(),
                    reason='JAX\'s CUDA plugin is not installed: pip install -e ".[cuda]"')
@pytest.mark.filterwarnings("ignore:Error reading persistent compilation cache entry:UserWarning")
def test_gpu_compiler_peak_as_predicted_with_and_without():
    """8 deviceless H100s, data2 x tensor4, 4 layers of width 2048 at sequence 2048 in bf16:
    the GPU compiler's per-device peak within ±10 % of the prediction with sequence
    parallelism off and on; on, the block's all-reduces are reduce-scatters + all-gathers and
    the peak falls (11 %: 2.15 -> 1.91 GB; 24 % while the norms kept float32 copies of the
    residual stream, which sequence parallelism splits); the collective bytes within ±5 % of
    the prediction both ways. Predicted, stop 31: off +2.0 %, on -9.3 % (jax 0.12: +0.5 %,
    -4.1 %; stop 29: +8.6 % and -4.0 %, while a whole reduced copy of the gradients was
    charged beside the backward, where the GPU program all-reduces them layer by layer:
    plan/update.update_terms; on, what the rings hold is not charged, docs/planner.md §7
    "Stop 31")."""
    topo = gpu_topology(8, "H100")
    sets = ["model.layers=4", "model.d_model=2048", "model.heads=16", "model.vocab_size=1024",
            "model.compute_dtype=bfloat16", "data.seq_len=2048", "data.source=synthetic",
            "train.batch_size=8", "mesh.data=2", "mesh.stage=1", "mesh.fsdp=1", "mesh.tensor=4",
            "train.microbatches=1", "model.remat=none", "model.collective_matmul=true"]
    peaks = []
    for sp in ("false", "true"):
        config = jaxmp.load_config(None, sets + [f"train.sequence_parallel={sp}"])
        plan = gpt_plan(config, 8, device_kind="H100", platform="cuda")
        trainer = gpt_trainer(config, devices=list(topo.devices), with_data=False, plan=plan)
        m = measure_step(trainer)
        assert plan.layout.sequence_parallel == (sp == "true")
        assert plan.predicted.per_device_bytes == pytest.approx(m.peak_bytes, rel=0.10)
        assert (m.collectives.count_by_kind["reduce-scatter"] > 0) == (sp == "true")
        # On, the backward gathers each column-parallel input again (jaxmp.plan.sequence).
        assert plan.predicted.comm_bytes_per_step == pytest.approx(m.collectives.total_bytes,
                                                                   rel=0.05)
        peaks.append(m.peak_bytes)
        if sp == "true":  # the projections run as rings (jaxmp.sharding.ring)
            kinds = collective_overlap(m.compiled).by_kind()
            # jax 0.10.2: 92 sends, 37 of them beside a matmul at this width (jax 0.12: 22)
            assert kinds["collective-permute"]["async"] > 0
            assert kinds["all-gather"]["async"] <= 2 and kinds["reduce-scatter"]["async"] <= 1
    assert peaks[1] < 0.92 * peaks[0]


@pytest.mark.skipif(not cuda_plugin_installed(),
                    reason='JAX\'s CUDA plugin is not installed: pip install -e ".[cuda]"')
@pytest.mark.filterwarnings("ignore:Error reading persistent compilation cache entry:UserWarning")
def test_gpu_compiler_hides_the_ring_sends_behind_matmuls():
    """4 deviceless H100s, tensor 4, two of GPT-3 175B's blocks (12288 wide, sequence 2048,
    bf16): with the projections as ring collective matmuls every send (58) has a matmul
    between its start and done (jax 0.12's XLA: 22 of 36), and only the embedding's and head's all-gather /
    reduce-scatter stay (off: 8 of 10 all-gathers and 6 of 9 reduce-scatters exposed,
    docs/planner.md §6); the planner charges the blocks' tensor time as hidden. A compiled
    schedule, not a timing: no GPU measured it. (At 2048 wide, data 2, XLA's scheduler puts
    a matmul beside 37 of 92 sends only: the previous test.)"""
    topo = gpu_topology(4, "H100")
    sets = ["model.layers=2", "model.d_model=12288", "model.heads=96", "model.vocab_size=1024",
            "model.compute_dtype=bfloat16", "model.param_dtype=bfloat16",
            "data.seq_len=2048", "data.source=synthetic", "train.batch_size=1", "mesh.data=1",
            "mesh.stage=1", "mesh.fsdp=1", "mesh.tensor=4", "train.microbatches=1",
            "model.remat=none", "train.sequence_parallel=true", "model.collective_matmul=true"]
    config = jaxmp.load_config(None, sets)
    plan = gpt_plan(config, 4, device_kind="H100", platform="cuda")
    m = measure_step(gpt_trainer(config, devices=list(topo.devices), with_data=False, plan=plan))
    overlap = collective_overlap(m.compiled)
    kinds = overlap.by_kind()
    ring = kinds["collective-permute"]
    # jax 0.10.2's XLA: 57 of 58 beside a matmul; jax 0.12's: 22 of 36. The one left: the
    # first block's last input-gradient send, outside the layer loop, since the weight
    # gradient is one matmul over the re-gathered input (stop 30; was one per block)
    assert ring["async"] > 0 and ring["overlapped"] > ring["exposed"]
    exposed = [c for c in overlap.collectives if c.kind == "collective-permute"
               and not c.overlapped]
    assert (not any(c.in_loop for c in exposed) and len(exposed) <= 1) \
        or jax.__version_info__ >= (0, 11)
    assert kinds["all-gather"]["async"] <= 2 and kinds["reduce-scatter"]["async"] <= 1
    p = plan.predicted  # what stays exposed: the embedding's and the head's, and the ring
    # steps' latency (2 blocks x 10 ring passes x 3 sends)
    latency = 2 * RING_SENDS_PER_BLOCK * 3 * RING_STEP_LATENCY_S
    assert latency < p.comm_s["tensor"] < latency + 0.5 * p.comm_hidden_s["tensor"]


@pytest.mark.skipif(not cuda_plugin_installed(),
                    reason='JAX\'s CUDA plugin is not installed: pip install -e ".[cuda]"')
@pytest.mark.filterwarnings("ignore:Error reading persistent compilation cache entry:UserWarning")
def test_gpu_compiler_keeps_it_inside_the_accumulation_loop():
    """8 deviceless H100s, tensor 8, 2 microbatches: the GPU compiler's collective bytes as
    predicted for sequence parallelism (±5 %) and its peak well under the prediction without
    it (0.75 / 0.87 GB). Before the loop carried its microbatch (jaxmp.train.step), XLA's collective pipeliner
    re-ran the next microbatch's forward to gather the head's input an iteration early: bytes
    +47 % and a peak above sequence parallelism off (docs/planner.md §7). (The peak itself is
    under-predicted at this depth: 497 against 712 MiB, -30 % (-39 % before stop 29): the
    GPU program holds each gathered input in two layouts and gathers the next layer's an
    iteration early, docs/planner.md §7 "Stop 29".)"""
    topo = gpu_topology(8, "H100")
    sets = ["model.layers=2", "model.d_model=2048", "model.heads=16", "model.vocab_size=1024",
            "model.compute_dtype=bfloat16", "data.seq_len=2048", "data.source=synthetic",
            "train.batch_size=8", "mesh.data=1", "mesh.stage=1", "mesh.fsdp=1", "mesh.tensor=8",
            "train.microbatches=2", "model.remat=none", "model.collective_matmul=false"]
    # (rings, the default on GPUs, stop 30: 799 MB compiled, 0.92 of the prediction without)
    on, off = (jaxmp.load_config(None, sets + [f"train.sequence_parallel={sp}"])
               for sp in ("true", "false"))
    plan = gpt_plan(on, 8, device_kind="H100", platform="cuda")
    m = measure_step(gpt_trainer(on, devices=list(topo.devices), with_data=False, plan=plan))
    assert plan.layout.sequence_parallel and plan.layout.microbatches == 2
    assert plan.predicted.comm_bytes_per_step == pytest.approx(m.collectives.total_bytes,
                                                               rel=0.05)
    without = gpt_plan(off, 8, device_kind="H100", platform="cuda").predicted
    assert m.peak_bytes < 0.9 * without.per_device_bytes  # measured 0.85


def test_nemo_gpt3_175b_layout_with_sequence_parallelism():
    """NeMo's GPT-3 175B on 128 H100 (t4 x p8 x d4, interleaved x6, 64 microbatches of one
    sequence): sequence parallelism alone divides the stashed residuals and the stage
    boundary's buffers and sends by tensor, leaves the state as it was, and is no slower."""
    sets = [s for s in GPT3_175B if not s.startswith("train.batch_size")] + [
        "train.batch_size=256", "device.usable_fraction=0.95", "mesh.data=4", "mesh.stage=8",
        "mesh.tensor=4", "mesh.fsdp=1", "pipeline.schedule=interleaved",
        "pipeline.virtual_stages=6", "train.microbatches=64", "model.remat=full"]
    off, on = (gpt_plan(jaxmp.load_config(None, sets + [f"train.sequence_parallel={sp}"]), 128,
                        "H100", find_devices_needed=False).predicted
               for sp in ("false", "true"))
    parts = lambda p: {k.split(":")[0]: v for k, v in p.activation_parts.items()}
    assert parts(on)["residuals"] == pytest.approx(parts(off)["residuals"] / 4, rel=0.01)
    assert on.activation_bytes == pytest.approx(off.activation_bytes / 4, rel=0.01)
    assert on.comm_bytes["stage"] < off.comm_bytes["stage"]
    assert on.param_bytes + on.optimizer_bytes + on.grad_bytes == \
        off.param_bytes + off.optimizer_bytes + off.grad_bytes
    assert on.step_time_s <= off.step_time_s
    assert off.per_device_bytes - on.per_device_bytes > 4 * 2**30
