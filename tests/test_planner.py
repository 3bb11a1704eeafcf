"""jaxmp.plan: stage balancing (property test vs brute force), device profiles, the plan
search and its JSON, constraints, the Trainer's auto mesh, `jaxmp plan`, and predictions vs the
compiled program on 8 simulated devices."""
from __future__ import annotations

import itertools
import json
import random
import time

import jax
import pytest

from jaxmp import load_config
from jaxmp.cli import main
from jaxmp.cli.plan import planned_platform
from jaxmp.devices import DeviceProfile, match_kind, profile_for, profile_from_config
from jaxmp.errors import ConfigError, PlanError, UnknownDeviceError
from jaxmp.plan import InfeasibleError, balance_stages, make_plan, plan, stage_sums
from jaxmp.plan.render import render
from jaxmp.plan.search import factorisations
from jaxmp.recipes.gpt import gpt_costs, gpt_plan, gpt_trainer
from jaxmp.tools.verify import verify_prediction
from jaxmp.train.planning import CostSource

# Small model, 8-divisible dims: fast to trace and to compile on 8 simulated devices.
SMALL = ["model.layers=2", "model.d_model=64", "model.heads=8", "model.vocab_size=256",
         "train.batch_size=16", "data.seq_len=32"]
CPU = profile_for("CPU", measure_cpu=False)


def _config(*extra: str):
    return load_config(None, SMALL + list(extra))


# ---------------------------------------------------------------- balance_stages

def _brute(costs, k, limit, memory):
    best = None
    n = len(costs)
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = [0, *cuts, n]
        stages = list(zip(bounds, bounds[1:]))
        if limit is not None and any(sum(memory[a:b]) > limit for a, b in stages):
            continue
        worst = max(sum(costs[a:b]) for a, b in stages)
        best = worst if best is None else min(best, worst)
    return best


def test_balance_stages_matches_brute_force():
    rng = random.Random(0)
    for _ in range(1500):
        n = rng.randint(1, 9)
        k = rng.randint(1, n)
        costs = [rng.choice([0, rng.randint(0, 10), rng.random() * 10]) for _ in range(n)]
        memory = limit = None
        if rng.random() < 0.5:
            memory = [rng.choice([rng.random() * 5, rng.randint(0, 3)]) for _ in range(n)]
            limit = rng.choice([rng.random() * 15, rng.randint(0, 8)])
        best = _brute(costs, k, limit, memory)
        if best is None:
            with pytest.raises(InfeasibleError):
                balance_stages(costs, k, limit, memory)
            continue
        stages = balance_stages(costs, k, limit, memory)
        assert len(stages) == k and stages[0][0] == 0 and stages[-1][1] == n
        assert all(a < b for a, b in stages)
        assert all(stages[i][1] == stages[i + 1][0] for i in range(k - 1))
        assert max(stage_sums(costs, stages)) == pytest.approx(best, rel=1e-9, abs=1e-12)
        if limit is not None:
            assert max(stage_sums(memory, stages)) <= limit * (1 + 1e-9)


def test_balance_stages_errors_and_memory_default():
    with pytest.raises(InfeasibleError):
        balance_stages([1, 2], 3)
    with pytest.raises(InfeasibleError):
        balance_stages([1, 2], 0)
    with pytest.raises(InfeasibleError):
        balance_stages([5, 5], 1, memory_limit=6)  # memory defaults to the costs
    assert balance_stages([5, 1, 1, 1, 1, 1], 2) == [(0, 1), (1, 6)]
    assert balance_stages([1] * 96, 8) == [(12 * i, 12 * i + 12) for i in range(8)]


# ---------------------------------------------------------------- device profiles

@pytest.mark.parametrize("kind, name", [
    ("NVIDIA H100 80GB HBM3", "H100"), ("NVIDIA H200", "H200"),
    ("NVIDIA A100-SXM4-40GB", "A100-40GB"), ("NVIDIA A100 80GB PCIe", "A100-80GB"),
    ("cpu", "CPU"), ("A100-80GB", "A100-80GB"), ("TPU v9", None),
])
def test_device_kinds(kind, name):
    assert match_kind(kind) == name


def test_profile_overrides_and_unknown_devices():
    h = profile_for("H100", overrides={"inter_host_bw": 12.5e9, "peak_flops": 0})
    assert h.inter_host_bw == 12.5e9 and h.peak_flops == 989e12  # 0 keeps the table's value
    with pytest.raises(UnknownDeviceError):
        profile_for("TPU v9", strict=True)
    custom = profile_for("TPU v9", strict=True, overrides={"peak_flops": 1e15,
                                                          "memory_bytes": 32e9})
    assert custom.kind == "TPU v9" and custom.memory_bytes == 32e9
    with pytest.raises(UnknownDeviceError):
        profile_for("H100", overrides={"colour": "green"})
    cpu = profile_for("CPU")
    assert cpu.peak_flops > 1e8 and cpu.shared_host and cpu.memory_bytes > 2**28


# ---------------------------------------------------------------- the search

def test_factorisations():
    assert len(factorisations(8)) == 20  # ordered 4-tuples with product 2**3: C(6, 3)
    assert len(factorisations(1024)) == 286
    fixed = factorisations(8, {"tensor": 2, "stage": 1})
    assert fixed and all(f["tensor"] == 2 and f["stage"] == 1 for f in fixed)


def _gpt_plan(config, n, device_kind="CPU"):  # as `jaxmp plan` plans: every policy ranked
    return gpt_plan(config, n, device_kind, remats=("none", "save_dots", "full"), strict=True,
                    measure_cpu=True)


@pytest.fixture(scope="module")
def small_plan():
    return _gpt_plan(_config(), 8)


def test_plan_json_shape(small_plan):
    out = json.loads(json.dumps(small_plan.to_json()))
    assert set(out["mesh"]) == {"data", "stage", "fsdp", "tensor"}
    assert out["mesh"]["data"] * out["mesh"]["stage"] * out["mesh"]["fsdp"] * \
        out["mesh"]["tensor"] == 8
    assert out["mesh"]["stage"] == 1 and out["status"] == "runnable" and out["fits"]
    assert out["stages"] == [[0, len(out["layers"])]]
    assert out["xla_flags"] == small_plan.layout.xla_flags  # what its GPU compile adds
    for key in ("per_device_bytes", "step_time_s", "flops_per_step", "comm_bytes_per_step"):
        assert out["predicted"][key] >= 0
    assert out["planning_time_s"] > 0 and out["alternatives"]
    assert all(alt["reason"] for alt in out["alternatives"])
    assert "blocks/mlp/up" in out["param_specs"]
    fsdp = _gpt_plan(_config("mesh.fsdp=8"), 8)  # the choice is load-dependent
    assert fsdp.param_specs["blocks/mlp/up"] == [None, "fsdp"]  # (layers, embed, mlp)
    assert [layer["name"] for layer in out["layers"]][:2] == ["pre", "blocks/0"]


def test_pipeline_candidates_are_runnable(small_plan):
    cost = gpt_costs(_config())
    full = plan(cost, 8, CPU, top=1000, configured_remat="none")
    piped = [a for a in full.alternatives if a["mesh"]["stage"] > 1]
    assert piped, "stage > 1 factorisations are enumerated"
    for alt in piped:
        assert alt["runnable"] == (alt["remat"] == "none"), alt["reason"]
        assert len(alt["stages"]) == alt["mesh"]["stage"] * alt["virtual_stages"]
        assert alt["predicted"]["bubble_s"] > 0
        assert alt["schedule"] in ("1f1b", "interleaved")
        assert alt["microbatches"] >= alt["mesh"]["stage"]


def test_explicit_axes_are_constraints():
    p = _gpt_plan(_config("mesh.fsdp=4"), 8)
    assert p.mesh["fsdp"] == 4
    with pytest.raises(ConfigError):  # no layout of 8 devices has tensor=3
        _gpt_plan(_config("mesh.tensor=3"), 8)


def test_tight_memory_picks_sharding_over_replication():
    cost = gpt_costs(_config())
    replicated = plan(cost, 8, CPU, fixed={"data": 8}).predicted.per_device_bytes
    sharded = plan(cost, 8, CPU, fixed={"fsdp": 8}).predicted.per_device_bytes
    assert sharded < replicated
    tight = DeviceProfile("tiny", 1e12, (sharded + replicated) / 2, 1e11, 1e10,
                          devices_per_host=8, usable_fraction=1.0)
    # (replicated: the optimizer state too — sharding it over data is tests/test_zero.py's)
    p = plan(cost, 8, tight, configured_remat="none", optimizer_sharding="none")
    assert p.fits and p.mesh["data"] < 8
    assert p.predicted.per_device_bytes <= tight.memory_bytes
    lost = [a for a in p.alternatives if a["mesh"]["data"] == 8 and a["remat"] == "none"
            and a["optimizer_sharding"] == "none"]
    assert all("does not fit" in a["reason"] for a in lost)


def test_axes_spanning_hosts_use_the_slow_link():
    from jaxmp.plan.predict import Context

    cost = gpt_costs(_config())
    slow = DeviceProfile("x", 1e12, 1e12, 1e11, 1e6, devices_per_host=2, overlap=False)
    ctx = Context(cost, slow, 8)
    bw = ctx.link_bw({"data": 4, "stage": 1, "fsdp": 1, "tensor": 2})
    assert bw["tensor"] == 1e11 and bw["data"] == 1e6  # tensor inside a host, data across
    bw = ctx.link_bw({"data": 1, "stage": 1, "fsdp": 4, "tensor": 2})
    assert bw["fsdp"] == 1e6
    fast = DeviceProfile("y", 1e12, 1e12, 1e11, 1e11, devices_per_host=2, overlap=False)
    data_slow = plan(cost, 8, slow, fixed={"data": 8}).predicted
    data_fast = plan(cost, 8, fast, fixed={"data": 8}).predicted
    assert data_slow.comm_bytes_per_step == data_fast.comm_bytes_per_step
    # data 8 over 4 hosts of 2: 2 members per host, 2 rings through 2 NICs per host
    assert data_slow.comm_s["data"] == pytest.approx(data_fast.comm_s["data"] * 1e5 / 2)
    # a group with g members per host spreads its cross-host traffic over g NICs
    rail = Context(cost, DeviceProfile("z", 1e12, 1e12, 4e11, 5e10, devices_per_host=8,
                                       overlap=False), 64)
    bw = rail.link_bw({"data": 1, "stage": 1, "fsdp": 64, "tensor": 1})
    assert bw["fsdp"] == 4e11  # min(intra, 8 x 50e9)
    bw = rail.link_bw({"data": 4, "stage": 2, "fsdp": 2, "tensor": 4})
    assert bw["fsdp"] == 4e11 and bw["stage"] == 5e10 and bw["data"] == 5e10  # 1 per host


def test_the_trainers_auto_mesh_is_runnable_and_respects_the_config():
    trainer = gpt_trainer(_config(), devices=jax.devices()[:8], with_data=False)
    mesh = dict(trainer.mesh.shape)
    assert trainer.plan is not None and trainer.plan.runnable and mesh == trainer.plan.mesh
    assert mesh["stage"] == 1 and mesh["data"] * mesh["fsdp"] * mesh["tensor"] == 8
    explicit = gpt_trainer(_config("mesh.tensor=2", "mesh.data=-1"), devices=jax.devices()[:8],
                           with_data=False)  # spelled out (-1 fills): the plan keeps it
    assert explicit.plan.mesh == {"data": 4, "stage": 1, "fsdp": 1, "tensor": 2}
    assert explicit.mesh.shape["tensor"] == 2


def test_any_model_plans():
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.layers = nnx.List([nnx.Linear(64, 64, rngs=rngs) for _ in range(4)])

        def __call__(self, x):
            for layer in self.layers:
                x = jax.nn.relu(layer(x))
            return x

    batch = jax.ShapeDtypeStruct((32, 64), jax.numpy.float32)
    p = make_plan(load_config(), CostSource(lambda rngs: Net(rngs), None,
                                            example_batch=batch).get(), 8)
    assert p.runnable and p.mesh["stage"] == 1
    assert [lay["name"] for lay in p.layers][1:5] == [f"layers/{i}" for i in range(4)]
    assert "layers/0/kernel" in p.param_specs


def test_96_layers_on_1024_devices_plans_fast():
    config = load_config(None, ["model.layers=96", "model.d_model=256", "model.heads=8",
                                "model.vocab_size=1024", "train.batch_size=2048",
                                "data.seq_len=64"])
    cost = gpt_costs(config, ("none", "full"))
    h100 = profile_for("H100")
    cpu_times = []
    for _ in range(2):  # the better of two: CI machines are shared
        start = time.process_time()
        p = plan(cost, 1024, h100, configured_remat="none")
        cpu_times.append(time.process_time() - start)
    assert min(cpu_times) < 2.0, cpu_times
    assert p.planning_time_s > 0
    assert len(p.layers) == 99 and p.fits


# ---------------------------------------------------------------- CLI

def _run_cli(*argv: str) -> int:
    return main(["plan", *argv])


def test_cli_json(capsys):
    assert _run_cli("--devices", "8", "--device-kind", "H100", "--json", "--top", "3",
                    *sum((["--set", s] for s in SMALL), [])) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"mesh", "stages", "predicted", "alternatives", "planning_time_s"} <= set(out)
    assert len(out["alternatives"]) <= 3 and out["device"]["kind"] == "H100"


def test_cli_plans_the_kernels_of_the_gpus_it_plans_for(capsys):
    """``jaxmp plan --device-kind H100`` on a machine without one plans what ``jaxmp train``
    runs on the H100s — cuDNN's attention with bf16 — not what this CPU could run; with
    ``--verify`` (no ``--aot``) the plan is for the devices here, which compile it."""
    bf16 = [*sum((["--set", s] for s in SMALL), []), "--set", "model.compute_dtype=bfloat16"]
    assert _run_cli("--devices", "8", "--device-kind", "H100", "--json", "--top", "1",
                    *bf16) == 0
    assert json.loads(capsys.readouterr().out)["layout"]["attention"] == "cudnn"
    config = load_config(None)
    assert planned_platform(config, "NVIDIA A100-SXM4-80GB", True) == "cuda"
    assert planned_platform(load_config(None, ["device.kind=H200"]), None, True) == "cuda"
    assert planned_platform(config, "H100", False) is None  # --verify here
    assert planned_platform(config, "CPU", True) is None
    assert planned_platform(config, None, True) is None


def test_cli_says_when_a_setting_turned_on_cannot_act(capsys):
    """ZeRO over data=1 and sequence parallelism at tensor=1 are no errors, but the plan says
    it built neither."""
    assert _run_cli("--devices", "8", "--device-kind", "H100", "--json", "--top", "1",
                    *sum((["--set", s] for s in SMALL), []), "--set", "mesh.data=1",
                    "--set", "mesh.tensor=1", "--set", "train.optimizer_sharding=data",
                    "--set", "train.sequence_parallel=true") == 0
    notes = " ".join(json.loads(capsys.readouterr().out)["notes"])
    assert "train.optimizer_sharding='data' shards nothing here (data=1)" in notes
    assert "train.sequence_parallel=true: the chosen layout does not shard" in notes


def test_cli_bad_input(capsys):
    assert _run_cli("--devices", "0") == 2
    assert _run_cli("--device-kind", "TPU v9", "--devices", "8") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "--devices" in err[0] and "TPU v9" in err[1]


def test_text_report(small_plan):
    text = render(small_plan, "16 x 32 tokens")
    assert "chosen:" in text and "alternatives:" in text and "blocks/0" in text


# ---------------------------------------------------------------- predictions vs compiled

@pytest.mark.parametrize("axes,remat", [({"data": 8}, None), ({"fsdp": 8}, None),
                                        ({"tensor": 8}, None),
                                        ({"data": 2, "fsdp": 2, "tensor": 2}, None),
                                        ({"data": 2, "fsdp": 2, "tensor": 2},
                                         "save_dots_except_mlp_in")],
                         ids=["data8", "fsdp8", "tensor8", "data2xfsdp2xtensor2",
                              "data2xfsdp2xtensor2-save_dots_except_mlp_in"])
def test_predictions_match_the_compiled_step(axes, remat):
    """Argument bytes within 5 %, peak within 15 %, collective bytes within 10 %. Sequence
    parallelism off: tensor 8's peak is under-predicted by the same 0.5 MB with it on (a
    larger share of its smaller peak: -19 % against -13 %); tests/test_sequence_parallel.py
    checks what it changes. A name-based remat policy (``remat``) is measured like the others."""
    assert len(jax.devices()) >= 8
    fixed = [f"mesh.{a}={axes.get(a, 1)}" for a in ("data", "stage", "fsdp", "tensor")]
    fixed.append("train.sequence_parallel=false")
    fixed += [f"model.remat={remat}"] if remat else []
    config = _config(*fixed)
    p = gpt_plan(config, 8, "CPU", strict=True)
    assert {k: v for k, v in p.mesh.items() if v > 1} == axes
    v = verify_prediction(lambda d: gpt_trainer(config, devices=d, with_data=False, plan=p), p,
                          jax.devices())
    assert v["layout"] == "as planned"
    assert v["argument_bytes"]["rel_err"] < 0.05, v
    assert v["peak_bytes"]["rel_err"] < 0.15, v
    assert v["comm_bytes_per_step"]["rel_err"] < 0.10, v


def test_config_profile_detects_the_cpu():
    assert profile_from_config(_config().device).kind == "CPU"


def test_trainer_plans_a_custom_model_from_an_example_batch(tmp_path):
    """mesh on auto + example_batch: the Trainer plans any NNX model and writes plan.json."""
    import json

    import numpy as np
    from flax import nnx

    import jaxmp

    class MLP(nnx.Module):
        def __init__(self, rngs):
            init = jax.random.normal
            self.w1 = nnx.Param(init(rngs.params(), (32, 128)) * 0.1,
                                out_sharding=("embed", "mlp"), eager_sharding=False)
            self.w2 = nnx.Param(init(rngs.params(), (128, 32)) * 0.1,
                                out_sharding=("mlp", "embed"), eager_sharding=False)

        def __call__(self, x):
            return jax.nn.relu(x @ self.w1[...]) @ self.w2[...]

    def loss(model, b):
        return jax.numpy.mean((model(b["x"]) - b["y"]) ** 2)

    def data():
        rng = np.random.default_rng(0)
        while True:
            x = rng.normal(size=(16, 32)).astype(np.float32)
            yield {"x": x, "y": x[:, ::-1].copy()}

    config = load_config(None, ["train.steps=2", "logging.every=1", "checkpoint.enabled=false",
                                "logging.tensorboard=false", "logging.progress=false"])
    example = {k: jax.ShapeDtypeStruct((16, 32), jax.numpy.float32) for k in ("x", "y")}
    trainer = jaxmp.Trainer(config, MLP, loss, data(), run_dir=tmp_path, example_batch=example)
    assert trainer.plan.predicted.step_time_s > 0
    assert dict(trainer.mesh.shape) == trainer.plan.mesh
    trainer.fit()
    written = json.loads((tmp_path / "plan.json").read_text())
    assert written["mesh"] == trainer.plan.mesh and "alternatives" in written


def test_saved_divisor_splits_a_head_count_factored_in_two():
    """GQA's ``[batch, kv_heads, group, seq, seq]`` scores split over tensor like the heads
    (kv 2 x group 6 = heads 12 on tensor 4), a head's width (heads x head_dim, the last dims)
    does not count, and a plain split dim still does."""
    from jaxmp.plan.divisor import saved_divisor

    div = saved_divisor(frozenset({12, 4096}), 4)
    assert div((8, 2, 6, 1024, 1024), 0) == 4
    assert div((8, 1024, 2, 128), 0) == 1  # kv heads 2 (replicated) x head_dim 128
    assert div((8, 1024, 32, 128), 0) == 1  # 32 x 128 = 4096, but the last dims: a width
    assert div((8, 1024, 4096), 0) == 4
    assert saved_divisor(frozenset({12}), 1)((8, 2, 6, 16, 16), 0) == 1
