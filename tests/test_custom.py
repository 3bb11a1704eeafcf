"""Bring your own model: examples/train_custom.py trains a conv classifier through jaxmp.Trainer.

The script runs in this process (conftest's 8 CPU devices) on data2×fsdp2×tensor2; the same
model, loss and data on one device must give the same losses, which shows the Trainer shards a
non-GPT model without changing what it computes.
"""
from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxmp import rules

STEPS = 30
QUIET = ["checkpoint.enabled=false", "logging.every=1", "logging.tensorboard=false"]


@pytest.fixture(scope="module")
def tc():
    """examples/train_custom.py imported as a module (its device preamble runs only as __main__)."""
    import train_custom

    return train_custom


@pytest.fixture(scope="module")
def sharded_run(tc, tmp_path_factory) -> list[dict]:
    """The script's own entry point, 8 devices, as a user runs it; returns metrics.jsonl."""
    run_dir = tmp_path_factory.mktemp("custom") / "run"
    argv = ["--steps", str(STEPS), "--run-dir", str(run_dir)]
    for kv in QUIET:
        argv += ["--set", kv]
    final = tc.main(argv)
    assert final["step"] == STEPS
    path = run_dir / "metrics.jsonl"
    assert path.is_file()
    assert (run_dir / "config.toml").is_file() and (run_dir / "plan.json").is_file()
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_custom_model_trains(sharded_run: list[dict]) -> None:
    assert [r["step"] for r in sharded_run] == list(range(1, STEPS + 1))
    for key in ("loss", "tokens_per_s", "step_time_s", "mfu", "grad_norm", "lr"):
        assert key in sharded_run[-1], key
    losses = np.array([r["loss"] for r in sharded_run])
    assert np.all(np.isfinite(losses))
    assert losses[:5].mean() > 2.0  # about ln 10 and above at the start
    assert losses[-5:].mean() < 0.6 * losses[:5].mean(), losses


def test_both_naming_ways_shard(tc) -> None:
    """Metadata names (dense head) and path rules (stock nnx.Conv) both reach the mesh."""
    mesh = jax.make_mesh((2, 1, 2, 2), ("data", "stage", "fsdp", "tensor"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 4)
    model = nnx.eval_shape(lambda: tc.ConvNet(rngs=nnx.Rngs(0)))
    specs = rules.specs_for(model, mesh, rules=tc.RULES,
                            path_rules=tc.PATH_RULES)
    flat = {"/".join(_key(k) for k in path): spec for path, spec in
            jax.tree_util.tree_flatten_with_path(
                specs, is_leaf=lambda x: isinstance(x, P))[0]}
    assert flat["conv1/kernel"] == P(None, None, None, "tensor")  # path rule
    assert flat["conv2/kernel"] == P(None, None, "fsdp", "tensor")  # path rule + RULES
    assert flat["hidden/kernel"] == P("fsdp", "tensor")  # Param metadata + default rules
    assert flat["out/kernel"] == P("tensor")  # "classes" replicated by RULES


def _key(k) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def test_custom_model_matches_single_device(tc, sharded_run: list[dict], tmp_path: Path) -> None:
    config = tc.make_config(STEPS, [*QUIET, "logging.progress=false",
                                    "mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1"])
    single = tc.make_trainer(config, str(tmp_path / "one"), devices=jax.devices()[:1])
    assert single.mesh.size == 1
    single.fit()
    np.testing.assert_allclose([r["loss"] for r in sharded_run],
                               [r["loss"] for r in single.history], rtol=1e-5,
                               err_msg="data2×fsdp2×tensor2 losses differ from one device")
    np.testing.assert_allclose([r["grad_norm"] for r in sharded_run],
                               [r["grad_norm"] for r in single.history], rtol=1e-4)
