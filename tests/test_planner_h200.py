"""The planner's time model against one real H200 (docs/planner.md §5, "One H200"): gpt-1b's
remat / microbatch choices ranked as the GPU measured them. Planning only, nothing compiled."""
from __future__ import annotations

from pathlib import Path

import pytest

from jaxmp import load_config
from jaxmp.devices import PROFILES
from jaxmp.plan.context import Context
from jaxmp.plan.predict import predict
from jaxmp.recipes.gpt import gpt_costs, gpt_plan

ONE = {"data": 1, "stage": 1, "fsdp": 1, "tensor": 1}
MESH = [f"mesh.{axis}=1" for axis in ONE]


def _config(batch: int, model: str = "gpt-1b"):
    return load_config(Path(__file__).parents[1] / f"jaxmp/configs/{model}.toml",
                       MESH + [f"train.batch_size={batch}", "model.remat=auto"])


def _steps(batch: int, runs: list[tuple[str, int]], model: str = "gpt-1b",
           attention: str = "cudnn") -> dict[tuple[str, int], float]:
    config = _config(batch, model)
    cost = gpt_costs(config, ("none", "save_dots", "full"), attention=attention)
    ctx = Context(cost, PROFILES["H200"], 1, compute_dtype=config.model.compute_dtype)
    return {run: predict(ctx, ctx.layout(ONE, *run)).step_time_s for run in runs}


# Measured on the H200 before stop 28 recomputed the block's norms and GELU in the backward
# (jaxmp.models.vjp.recomputed): remat none then stored their float32 / tanh intermediates. The
# time model now charges remat none less traffic and ranks it ahead; what the H200 does with
# the new program is not measured yet (no GPU at stop 28): re-measure, then re-derive.
RECOMPUTE_UNMEASURED = pytest.mark.xfail(
    strict=True, reason="H200 measured before the block's norms and GELU were recomputed")


@RECOMPUTE_UNMEASURED
def test_remat_ranking_at_batch_8_is_the_h200s():
    # Measured (ms): save_dots 295 < none 319 < full 339.
    t = _steps(8, [("save_dots", 1), ("none", 1), ("full", 1)])
    assert t[("save_dots", 1)] < t[("none", 1)] < t[("full", 1)]
    for run, measured in {("save_dots", 1): 0.295, ("none", 1): 0.319,
                          ("full", 1): 0.339}.items():
        assert t[run] == pytest.approx(measured, rel=0.10), run


@RECOMPUTE_UNMEASURED
def test_auto_at_batch_16_picks_what_ran_fastest():
    # Measured (ms): save_dots x1 567 < save_dots x2 598 < full 649 < none x2 698 (the
    # planner's choice before the memory-traffic terms).
    plan = gpt_plan(_config(16), 1, device_kind="H200", platform="cuda")
    assert (plan.remat, plan.microbatches) == ("save_dots", 1)
    t = _steps(16, [("save_dots", 1), ("save_dots", 2), ("none", 2)])
    assert t[("save_dots", 1)] < t[("save_dots", 2)] < t[("none", 2)]


def test_causal_cudnn_attention_skips_its_masked_half():
    cost = gpt_costs(_config(8), ("none", "save_dots"), attention="cudnn")
    block = next(lay for lay in cost.layers if lay.kind == "block")
    recomputed = block.recompute_flops["save_dots"]  # the attention's forward, rerun
    assert recomputed > 0
    skipped = block.skipped_flops["save_dots"] - block.skipped_flops["none"]
    assert skipped == pytest.approx(recomputed / 2, rel=0.01)
    assert 0 < block.run_flops("none") < block.flops("none")


def test_xla_attention_pays_for_its_score_traffic():
    # Measured (ms, batch 8, save_dots): cuDNN 295, XLA 525. XLA's S x S scores and
    # probabilities through HBM and its thin attention matmuls (jaxmp.cost.traffic) take it
    # from -36 % to -22 %; the rest is not modelled (docs/planner.md §4, Limits).
    xla = _steps(8, [("save_dots", 1)], attention="xla")[("save_dots", 1)]
    assert xla == pytest.approx(0.525, rel=0.25)
    assert xla > 1.25 * 0.295


@RECOMPUTE_UNMEASURED
def test_gpt2_small_remat_ranking_is_the_h200s():
    # Measured (ms, batch 32 x 1024): save_dots 70.4 < full 72.1 < none 81.4; predicted within
    # -20 % (small models' elementwise work is not all charged: docs/planner.md §4). full and
    # none are predicted within 1 % of each other (jax 0.10: full first, jax 0.12: none):
    # only save_dots' lead is pinned.
    t = _steps(32, [("save_dots", 1), ("none", 1), ("full", 1)], model="gpt2-small")
    assert t[("save_dots", 1)] < min(t[("full", 1)], t[("none", 1)])
    assert t[("full", 1)] == pytest.approx(t[("none", 1)], rel=0.02)
    for run, measured in {("save_dots", 1): 0.0704, ("none", 1): 0.0814,
                          ("full", 1): 0.0721}.items():
        assert t[run] == pytest.approx(measured, rel=0.20), run
