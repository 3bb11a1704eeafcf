"""Checkpoints describe themselves, restore on any mesh, and are never read half-written."""
from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxmp
from jaxmp import checkpoint, rules
from jaxmp.checkpoint import CheckpointError
from jaxmp.cli import main as ckpt_main
from jaxmp.config import OptimizerConfig
from jaxmp.train.optimizer import make_optimizer
from jaxmp.train.state import init_state, plan_state
from test_checkpoint_helpers import Bigram

MESHES = [({"fsdp": 4}, 4), ({"fsdp": 2}, 2), ({}, 1), ({"data": 8}, 8)]


def _model(rngs):
    return Bigram(256, 64, rngs)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A train state (params + Adam moments, made non-zero) saved from fsdp2 x tensor4."""
    mesh = jaxmp.make_mesh({"fsdp": 2, "tensor": 4})
    tx = make_optimizer(OptimizerConfig(), 10)
    layout = plan_state(_model, tx, mesh)
    state = init_state(layout, _model, tx, seed=0)
    state = state.replace(opt_state=jax.tree.map(lambda x: x + 0.5, state.opt_state))
    root = tmp_path_factory.mktemp("ckpt")
    checkpoint.save(root / "checkpoints", 7, state, config_toml="[train]\nsteps = 7\n",
                    data_state={"step": 7})
    return root, state, checkpoint.digest(state)


def test_checkpoint_describes_itself(saved):
    root, state, _ = saved
    info = checkpoint.info(root)
    assert info["step"] == 7 and info["data"] == {"step": 7}
    assert info["run"]["config_toml"].startswith("[train]")
    meta = info["meta"]
    assert meta["mesh"] == {"data": 1, "stage": 1, "fsdp": 2, "tensor": 4}
    assert meta["devices"] == 8 and meta["processes"] == 1
    embed = meta["arrays"]["params/embed"]
    assert len(embed.pop("checksum")) == 16  # see test_safe_load.py
    assert embed == {"shape": [256, 64], "dtype": "float32", "names": ["vocab", "embed"],
                     "spec": ["tensor", "fsdp"], "bytes": 256 * 64 * 4}
    assert meta["arrays"]["opt_state/1/0/mu/out"]["names"] == ["embed", "vocab"]
    assert meta["arrays"]["step"]["names"] is None and meta["arrays"]["step"]["spec"] == []


@pytest.mark.parametrize("axes,n", MESHES, ids=["fsdp4", "fsdp2", "single", "data8"])
def test_restore_on_any_mesh_gives_identical_values(saved, axes, n):
    root, _, want = saved
    mesh = jaxmp.make_mesh(axes, jax.devices()[:n])
    state = checkpoint.restore(root, mesh=mesh, what="state")
    assert checkpoint.digest(state) == want
    embed = state["params"]["embed"]
    assert embed.sharding.mesh == mesh
    assert embed.sharding.spec == rules.logical_spec(("vocab", "embed"), (256, 64), mesh)


def test_restore_chain_8_4_2_1_and_back(saved, tmp_path):
    root, _, want = saved
    src = root
    for i, (axes, n) in enumerate([({"fsdp": 4}, 4), ({"tensor": 2}, 2), ({}, 1)]):
        state = checkpoint.restore(src, mesh=jaxmp.make_mesh(axes, jax.devices()[:n]),
                                   what="state")
        names = checkpoint.logical_names(src)  # plain arrays carry no names: reuse the stored
        src = tmp_path / f"hop{i}"
        checkpoint.save(src, 7, state, names=names)
    back = checkpoint.restore(src, mesh=jaxmp.make_mesh({"fsdp": 2, "tensor": 4}), what="state")
    assert checkpoint.digest(back) == want
    meta = checkpoint.info(src)["meta"]
    assert meta["mesh"] == {"data": 1, "stage": 1, "fsdp": 1, "tensor": 1}
    assert meta["arrays"]["params/out"]["names"] == ["embed", "vocab"]
    assert back["params"]["out"].sharding.spec == P("fsdp", "tensor")


def test_restore_params_only_with_other_rules(saved):
    root, state, _ = saved
    mesh = jaxmp.make_mesh({"data": 8})
    params = checkpoint.restore(root, mesh=mesh, rules=[("vocab", "data")])
    assert set(params) == {"embed", "out"}
    assert params["embed"].sharding.spec == P("data")
    assert params["out"].sharding.spec == P(None, "data")
    np.testing.assert_array_equal(np.asarray(params["out"]), np.asarray(state.params["out"][...]))
    opt = checkpoint.restore(root, mesh=mesh, what="opt_state")
    assert set(opt) == {"0", "1", "2"} or set(opt) == {"1"}
    with pytest.raises(CheckpointError, match="has no 'nope' arrays; .*params"):
        checkpoint.restore(root, mesh=mesh, what="nope")


def test_prng_keys_and_bfloat16_round_trip(tmp_path):
    mesh = jaxmp.make_mesh({"fsdp": 2, "tensor": 4})
    keys = jax.random.split(jax.random.key(3), 8)
    w = jnp.arange(64 * 32, dtype=jnp.bfloat16).reshape(64, 32)
    state = {"params": {"w": jax.device_put(w, jax.NamedSharding(mesh, P("fsdp", "tensor")))},
             "rest": {"key": keys}}
    checkpoint.save(tmp_path, 1, state, path_rules=[(r"w$", ("embed", "mlp"))])
    meta = checkpoint.info(tmp_path)["meta"]["arrays"]
    assert meta["rest/key"]["prng_impl"] == "threefry2x32" and meta["rest/key"]["shape"] == [8, 2]
    assert meta["params/w"]["names"] == ["embed", "mlp"]
    back = checkpoint.restore(tmp_path, mesh=jaxmp.make_mesh({"tensor": 2}, jax.devices()[:2]),
                              what="state")
    assert jax.dtypes.issubdtype(back["rest"]["key"].dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(jax.random.key_data(back["rest"]["key"]),
                                  jax.random.key_data(keys))
    assert back["params"]["w"].dtype == jnp.bfloat16
    assert back["params"]["w"].sharding.spec == P(None, "tensor")
    np.testing.assert_array_equal(np.asarray(back["params"]["w"], np.float32),
                                  np.asarray(w, np.float32))


def _two_steps(tmp_path):
    """Checkpoints at steps 1 and 2 whose params differ: which one a restore read is visible."""
    mesh = jaxmp.make_mesh({"fsdp": 8})
    for step in (1, 2):
        x = jax.device_put(jnp.full((64, 8), float(step)), jax.NamedSharding(mesh, P("fsdp")))
        checkpoint.save(tmp_path, step, {"params": {"x": x}})
    return mesh


def _step_of(tmp_path, mesh, **kw):
    return float(checkpoint.restore(tmp_path, mesh=mesh, **kw)["x"][0, 0])


def test_interrupted_saves_are_never_picked(tmp_path):
    mesh = _two_steps(tmp_path)
    # A save killed before Orbax's rename leaves a tmp dir; one whose marker never landed
    # (e.g. a partial copy) lacks commit_success.txt. Neither may be restored.
    shutil.copytree(tmp_path / "2", tmp_path / "3.orbax-checkpoint-tmp-1234567")
    shutil.copytree(tmp_path / "2", tmp_path / "4")
    (tmp_path / "4" / "commit_success.txt").unlink()
    assert _step_of(tmp_path, mesh) == 2.0
    status = {(s.step, s.status) for s in checkpoint.list_steps(tmp_path)}
    assert status == {(1, "complete"), (2, "complete"), (3, "incomplete"), (4, "incomplete")}
    with pytest.raises(CheckpointError, match=r"step 4 .* is incomplete"):
        checkpoint.restore(tmp_path, step=4, mesh=mesh)


@pytest.mark.parametrize("damage", ["truncate", "delete", "meta"])
def test_damaged_latest_falls_back_with_a_message(tmp_path, capfd, damage):
    mesh = _two_steps(tmp_path)
    state = tmp_path / "2" / "state"
    data = [f for f in state.rglob("*") if f.is_file() and f.parent.name == "d"]
    if damage == "truncate":
        for f in data:
            f.write_bytes(f.read_bytes()[:7])
    elif damage == "delete":
        for f in data:
            f.unlink()
    else:
        (tmp_path / "2" / "meta" / "metadata").write_text("{not json")
    assert _step_of(tmp_path, mesh) == 1.0
    err = capfd.readouterr().err
    assert "checkpoint" in err and "2" in err and "falling back to step 1" in err
    with pytest.raises(CheckpointError) as e:
        checkpoint.restore(tmp_path, step=2, mesh=mesh)
    assert "\n" not in str(e.value) and str(tmp_path / "2") in str(e.value)


def test_bad_input_errors_are_one_clear_line(tmp_path, saved):
    root, _, _ = saved
    with pytest.raises(CheckpointError, match="checkpoint directory not found: .*nowhere"):
        checkpoint.restore(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match=r"no checkpoint for step 9 in .*; complete steps: 7"):
        checkpoint.restore(root, step=9)
    with pytest.raises(CheckpointError, match="no complete checkpoint in"):
        checkpoint.restore(tmp_path)


# ----------------------------------------------------------------------------------- CLI


def test_cli_list_and_inspect(saved, capsys):
    root, state, want = saved
    assert ckpt_main(["ckpt", "list", str(root), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)["steps"]
    assert [(s["step"], s["complete"]) for s in listed] == [(7, True)] and listed[0]["bytes"] > 0
    assert ckpt_main(["ckpt", "inspect", str(root / "checkpoints"), "--json", "--digest"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["step"] == 7
    assert {p: a["sha256"] for p, a in report["arrays"].items()} == want
    assert report["arrays"]["params/out"]["shape"] == [64, 256]
    assert report["arrays"]["params/out"]["dtype"] == "float32"
    assert ckpt_main(["ckpt", "inspect", str(root), "--step", "7"]) == 0
    table = capsys.readouterr().out
    assert "logical axes" in table and "(vocab, embed)" in table and "P('tensor', 'fsdp')" in table


def test_cli_export_safetensors(saved, tmp_path, capsys):
    safetensors = pytest.importorskip("safetensors.numpy")
    root, state, _ = saved
    out = tmp_path / "model.safetensors"
    assert ckpt_main(["ckpt", "export", str(root), "--out", str(out)]) == 0
    loaded = safetensors.load_file(str(out))
    assert set(loaded) == {"embed", "out"}
    np.testing.assert_array_equal(loaded["embed"], np.asarray(state.params["embed"][...]))
    from safetensors import safe_open

    with safe_open(str(out), "np") as f:
        names = json.loads(f.metadata()["logical_names"])
    assert names["embed"] == ["vocab", "embed"]


def test_cli_bad_input_exits_2(tmp_path, capsys):
    assert ckpt_main(["ckpt", "inspect", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "checkpoint directory not found" in err
