"""Multi-process training for real: 2 processes x 4 CPU devices (gloo) train exactly like 1 x 8.

Both runs go through the command line (``scripts/launch_local.sh`` and ``python -m jaxmp.cli``)
in subprocesses, started together so that their compiles overlap on a small CPU. The mesh is
the same (data2 x fsdp4) and so is the global batch stream, so the per-step losses must agree
to float32 round-off: any difference would mean a process read the wrong rows, or the mesh was
laid out over the processes differently from one host.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = ROOT / "scripts" / "launch_local.sh"
STEPS = 5
TINY = [f"--set={kv}" for kv in (
    "model.layers=2", "model.d_model=64", "model.heads=4", "train.batch_size=8",
    "data.seq_len=32", f"train.steps={STEPS}", "logging.every=1", "train.eval_every=0",
    "mesh.data=2", "mesh.fsdp=4", "mesh.stage=1", "mesh.tensor=1", "logging.tensorboard=false")]
TIMEOUT_S = 300

pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("bash") is None,
                                                   reason="the launcher is a bash script")]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # conftest's 8 devices must not leak into the subprocesses
    env.pop("JAX_PLATFORMS", None)  # --simulate-devices sets it
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env["PYTHON"] = sys.executable
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _start(cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen, what: str) -> str:
    """Wait for ``proc``; on a timeout or failure, fail the test with the end of its output."""
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.terminate()  # the launcher traps SIGTERM and stops (at worst kills) its processes
        try:
            out, _ = proc.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        pytest.fail(f"{what} timed out after {TIMEOUT_S}s; last output:\n{_tail(out)}")
    if proc.returncode != 0:
        pytest.fail(f"{what} exited with code {proc.returncode}; last output:\n{_tail(out)}")
    return out


def _tail(text: str | None, lines: int = 40) -> str:
    return "\n".join((text or "").splitlines()[-lines:])


def _metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    assert path.is_file(), f"no {path}"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_two_processes_match_one(tmp_path: Path) -> None:
    one_dir, two_dir = tmp_path / "one", tmp_path / "two"
    reference = _start([sys.executable, "-m", "jaxmp.cli", "train", *TINY,
                        "--simulate-devices", "8", "--run-dir", str(one_dir)])
    launched = _start(["bash", str(LAUNCH), "2", *TINY, "--run-dir", str(two_dir)])
    out_two = _finish(launched, "scripts/launch_local.sh 2 (2 processes x 4 devices)")
    _finish(reference, "jaxmp train (1 process x 8 devices)")

    one, two = _metrics(one_dir), _metrics(two_dir)
    # Only process 0 writes: one line per step, not one per process.
    assert [r["step"] for r in two] == list(range(1, STEPS + 1))
    assert [r["step"] for r in one] == list(range(1, STEPS + 1))
    np.testing.assert_allclose([r["loss"] for r in two], [r["loss"] for r in one], rtol=1e-5,
                               err_msg="2x4 multi-process losses differ from 1x8")
    np.testing.assert_allclose([r["grad_norm"] for r in two], [r["grad_norm"] for r in one],
                               rtol=1e-4)
    assert len(set(r["loss"] for r in one)) > 1  # the steps did train

    plan = json.loads((two_dir / "plan.json").read_text())
    assert plan["processes"] == 2 and plan["devices"] == 8
    assert plan["mesh"]["data"] == 2 and plan["mesh"]["fsdp"] == 4
    # Only process 0 prints progress; the launcher prefixes every line with its process index.
    assert f"[0] step {STEPS}/{STEPS}" in out_two, _tail(out_two)
    assert not any(line.startswith("[1] step") for line in out_two.splitlines()), _tail(out_two)


def test_launcher_reports_a_failed_process(tmp_path: Path) -> None:
    """A bad config fails in every process before any device work; the launcher exits 2."""
    proc = subprocess.run(["bash", str(LAUNCH), "2", "--set", "train.steps=0",
                           "--run-dir", str(tmp_path / "bad")], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "train.steps" in proc.stdout and "[" in proc.stdout.split("train.steps")[0]
    assert "exited with code 2" in proc.stderr


def test_launcher_usage() -> None:
    proc = subprocess.run(["bash", str(LAUNCH), "two"], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "usage" in proc.stderr
