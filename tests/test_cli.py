"""`jaxmp train` as a user runs it: a subprocess, a run directory, clear errors."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FAST_COMPILE_FLAGS

SMALL = ["--set", "train.steps=24", "--set", "logging.every=4", "--set", "train.eval_every=12",
         "--set", "model.layers=2", "--set", "model.d_model=64", "--set", "train.batch_size=8",
         "--set", "data.seq_len=64", "--set", "checkpoint.enabled=false"]


def jaxmp(*args: str, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "XLA_FLAGS": FAST_COMPILE_FLAGS, **(env or {})}
    return subprocess.run([sys.executable, "-m", "jaxmp.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env=full_env)


def test_train_writes_run_dir_and_loss_falls(tmp_path: Path):
    run = tmp_path / "run"
    r = jaxmp("train", "--run-dir", str(run), *SMALL, "--set", "logging.profile_steps=[2, 4]")
    assert r.returncode == 0, r.stderr[-2000:]
    assert (run / "config.toml").is_file() and (run / "plan.json").is_file()
    plan = json.loads((run / "plan.json").read_text())  # mesh "auto": the planner's choice
    assert plan["predicted"]["step_time_s"] > 0 and plan["mesh"]["data"] == 1
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [4, 8, 12, 16, 20, 24]
    for key in ("loss", "tokens_per_s", "step_time_s", "model_flops_per_step", "mfu",
                "grad_norm", "lr"):
        assert all(isinstance(x[key], float) for x in lines), key
    assert "eval_loss" in lines[2] and "eval_loss" in lines[-1]
    assert lines[-1]["loss"] < lines[0]["loss"] - 0.5
    assert 0 < lines[-1]["mfu"] < 1
    events = list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0
    assert list((run / "profile").rglob("*.xplane.pb")), "jax.profiler trace for steps [2, 4)"
    # the effective config round-trips: training again from it is valid input
    from jaxmp import load_config

    assert load_config(run / "config.toml").train.steps == 24


def test_train_on_simulated_mesh(tmp_path: Path):
    r = jaxmp("train", "--run-dir", str(tmp_path), "--simulate-devices", "4",
              "--set", "mesh.data=2", "--set", "mesh.fsdp=2", *SMALL[:2], "--set", "train.steps=4",
              *SMALL[4:])
    assert r.returncode == 0, r.stderr[-2000:]
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["mesh"] == {"data": 2, "stage": 1, "fsdp": 2, "tensor": 1}


BAD = [
    (["--set", "train.stpes=3"], "train.stpes"),
    (["--set", "train.steps=abc"], "train.steps"),
    (["--set", "train.steps=0"], "train.steps"),
    (["--set", "nosuch.key=1"], "nosuch"),
    (["--set", "trainsteps"], "trainsteps"),
    (["--set", "model.activation=relu6"], "model.activation"),
    (["--set", "model.heads=3"], "heads"),
    (["--set", "train.batch_size=10", "--set", "train.microbatches=3"], "microbatches"),
    (["--set", "optimizer.lr=-1"], "optimizer.lr"),
    (["--set", "mesh.data=3"], "mesh"),
    (["--set", "data.source=/nonexistent/tokens.bin"], "tokens.bin"),
    (["--set", "logging.profile_steps=[5, 2]"], "logging.profile_steps"),
    (["/nonexistent/config.toml"], "config.toml"),
    (["--simulate-devices", "0"], "simulate-devices"),
]


@pytest.mark.parametrize("args,needle", BAD, ids=[b[1] for b in BAD])
def test_bad_input_exits_2_with_one_line(args, needle, tmp_path: Path):
    r = jaxmp("train", "--run-dir", str(tmp_path / "run"), *args, timeout=120)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    lines = [x for x in r.stderr.splitlines() if x.strip() and "WARNING" not in x]
    assert len(lines) == 1, r.stderr
    assert needle in lines[0] and "Traceback" not in r.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_bad_toml_file(tmp_path: Path):
    cfg = tmp_path / "broken.toml"
    cfg.write_text("[train\nsteps = 3\n")
    r = jaxmp("train", str(cfg), "--run-dir", str(tmp_path / "run"))
    assert r.returncode == 2 and "broken.toml" in r.stderr and "Traceback" not in r.stderr
