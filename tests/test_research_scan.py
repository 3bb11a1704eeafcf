"""A second research model (examples/research_scan_lm.py): nnx.vmap/nnx.scan-stacked Llama
blocks, GQA through ``jax.nn.dot_product_attention``, RMSNorm, SwiGLU, tied embeddings via
``nnx.Embed.attend``, parameters named in the model's own names. Through jaxmp.Trainer a sharded
run equals one device in float32 — loss, gradients and the params after 3 steps — on fsdp,
tensor, data and data×fsdp×tensor meshes, with ZeRO-1 and with sequence parallelism.
"""
from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

import jaxmp
from jaxmp import rules
from jaxmp.checkpoint.records import flat_paths
from jaxmp.plan import make_plan
from jaxmp.tools.verify import verify_prediction
from jaxmp.train.planning import CostSource

QUIET = ["checkpoint.enabled=false", "logging.progress=false", "logging.tensorboard=false",
         "logging.every=1", "optimizer.eps=1e-4"]


@pytest.fixture(scope="module")
def lm():
    import research_scan_lm

    return research_scan_lm


def _trainer(lm, mesh: dict, devices=None, extra=()) -> jaxmp.Trainer:
    axes = [f"mesh.{a}={mesh.get(a, 1)}" for a in ("data", "stage", "fsdp", "tensor")]
    return lm.make_trainer(lm.make_config(3, [*axes, *QUIET, *extra]), "/tmp/unused",
                           devices=devices)


def _run(trainer: jaxmp.Trainer) -> tuple[list[float], dict]:
    """The losses of 3 steps and the params after them, gathered to host."""
    trainer.fit()
    params = jax.tree.map(np.asarray, trainer.state.params)
    return [r["loss"] for r in trainer.history], dict(zip(flat_paths(params),
                                                          jax.tree.leaves(params)))


@pytest.fixture(scope="module")
def one_device(lm):
    return _run(_trainer(lm, {}, devices=jax.devices()[:1]))


@pytest.mark.parametrize("mesh,extra", [  # fsdp alone and d2f2t2 without SP/ZeRO also held
    ({"tensor": 8}, ()),                     # (stop 34): left out for the suite's time
    ({"data": 8}, ("train.optimizer_sharding=data",)),
    ({"data": 2, "fsdp": 2, "tensor": 2}, ("train.sequence_parallel=true",
                                           "train.optimizer_sharding=data")),
], ids=["tensor8", "data8-zero1", "d2f2t2-sp-zero1"])
def test_three_steps_equal_one_device(lm, one_device, mesh, extra):
    losses, params = _run(_trainer(lm, mesh, extra=extra))
    ref_losses, ref_params = one_device
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert params.keys() == ref_params.keys()
    for path, p in params.items():
        r = ref_params[path]
        np.testing.assert_allclose(p, r, rtol=1e-4, atol=1e-5 * max(1.0, np.abs(r).max()),
                                   err_msg=path)


def test_lint_is_quiet_on_stacked_biasless_layers(lm):
    """Scanned (stacked) kernels without biases: balanced, nothing to warn about."""
    model = rules.abstract(lambda: lm.ScanLM(nnx.Rngs(0)))
    for mesh in ({"tensor": 8}, {"fsdp": 4, "tensor": 2}):
        report = rules.lint(model, jaxmp.make_mesh(mesh), rules=lm.RULES)
        assert report.shard_ratio <= 1.1 and report.warning() is None, report.warning()


@pytest.mark.parametrize("fsdp,tensor", [(8, 1), (1, 8)], ids=["fsdp8", "tensor8"])
def test_planner_as_compiled(lm, fsdp, tensor):
    """The planner on the scanned research model (docs/planner.md §7 Stop 34, Rm2; Stop 35,
    Rm3), CPU: fsdp 8 arguments exact, peak −0.9 %, collectives −3.6 %; tensor 8 peak +4.3 %
    (was −46 %: q's 2-D projection is as wide as the residual stream, so matching dims by size
    split every residual over tensor), its collectives −11.8 % (not modelled: the 2 kv heads'
    all-gathers, permutes and all-to-alls)."""
    example = {k: jax.ShapeDtypeStruct((16, 64), np.int32) for k in ("inputs", "targets")}
    cost = CostSource(lambda r: lm.ScanLM(r), lm.lm_loss, example_batch=example).get()
    config = lm.make_config(1, ["mesh.data=1", "mesh.stage=1", f"mesh.fsdp={fsdp}",
                                f"mesh.tensor={tensor}", *QUIET, "train.sequence_parallel=false"])
    plan = make_plan(config, cost, 8, rules=lm.RULES)
    v = verify_prediction(lambda d: jaxmp.Trainer(
        config, lambda r: lm.ScanLM(r), lm.lm_loss, None, rules=lm.RULES, devices=d, plan=plan,
        example_batch=example), plan, jax.devices())
    assert v["layout"] == "as planned"
    assert v["argument_bytes"]["rel_err"] < 1e-3, v
    assert v["peak_bytes"]["rel_err"] < 0.10, v
    assert v["comm_bytes_per_step"]["rel_err"] < (0.05 if tensor == 1 else 0.15), v
