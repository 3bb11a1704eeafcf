"""A disk that fills up during training: exit 1 with one line naming the cause, no partial
checkpoint left, the run files whole.

Two ways to run out of room: a small tmpfs (when this machine lets the test mount one), where
the save is refused before anything is written; and a file-size limit (``RLIMIT_FSIZE``, any
Linux), where the write fails half-way through and the partial save is removed.
"""
from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from jaxmp.checkpoint import list_steps
from test_checkpoint_helpers import REPO, TINY_GPT, jaxmp_cmd, subprocess_env

pytestmark = [pytest.mark.slow, pytest.mark.skipif(sys.platform != "linux", reason="Linux only")]
TRAIN = [a for kv in TINY_GPT + ["model.d_model=64", "train.steps=6", "checkpoint.every=2",
                                 "checkpoint.keep=1", "mesh.fsdp=2"] for a in ("--set", kv)]


def _train(run: Path, preexec=None) -> subprocess.CompletedProcess:
    env = subprocess_env(2)
    env.pop("JAX_COMPILATION_CACHE_DIR")  # its files are written under the same limits
    return subprocess.run(jaxmp_cmd("train", *TRAIN, "--run-dir", str(run)), cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600, preexec_fn=preexec)


def _jaxmp_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("jaxmp:")]


def _whole_run_files(run: Path) -> None:
    assert not [p for p in run.rglob("*") if "orbax-checkpoint-tmp" in p.name or
                p.name.endswith(".tmp")]
    for line in (run / "metrics.jsonl").read_text().splitlines():
        json.loads(line)  # no half-written line


def test_a_save_the_disk_cannot_hold_is_refused_before_writing(tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=700k", f"tmpfs-{uuid.uuid4().hex[:6]}",
             str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        r = _train(mount / "run")
        assert r.returncode == 1, r.stderr[-3000:]
        lines = _jaxmp_lines(r.stderr)
        assert lines == [lines[-1]] and lines[-1].startswith(
            f"jaxmp: failed: not enough disk space to save checkpoint step 2 in "
            f"{mount / 'run' / 'checkpoints'}: it needs about "), r.stderr[-3000:]
        assert "there is no complete checkpoint yet" in lines[-1]
        assert "Traceback" not in r.stderr
        _whole_run_files(mount / "run")
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_a_write_that_fails_half_way_is_one_line_and_leaves_nothing_partial(tmp_path):
    limit = 300_000  # bytes per file: the run files fit, the arrays of a checkpoint do not

    def small_files():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    r = _train(tmp_path / "run", small_files)
    assert r.returncode == 1, r.stderr[-3000:]
    lines = _jaxmp_lines(r.stderr)
    assert len(lines) == 1 and lines[0].startswith(
        "jaxmp: failed: saving checkpoint step 2 in "), r.stderr[-3000:]
    assert "File too large (errno 27); the partial save was removed" in lines[0]
    assert "Traceback" not in r.stderr and "never retrieved" not in r.stderr, r.stderr[-3000:]
    assert [s for s in list_steps(tmp_path / "run")] == []
    _whole_run_files(tmp_path / "run")
