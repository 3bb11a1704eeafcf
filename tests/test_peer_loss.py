"""One of two processes is SIGKILLed mid-run: the other exits on its own within 60 s with a
clear message (no hang), and starting both again resumes from the last complete checkpoint.

Both victims are tried: process 0 hosts JAX's coordination service, so losing it is noticed
differently (JAX ends the others itself) from losing process 1 (the survivors' collectives
fail, or the service misses its heartbeats). See jaxmp/train/peers.py.
"""
from __future__ import annotations

import re
import signal
import subprocess
import time

import pytest

from jaxmp.checkpoint import list_steps
from test_checkpoint_helpers import REPO, TINY_GPT, free_port, jaxmp_cmd, subprocess_env

pytestmark = pytest.mark.slow
STEPS, EVERY = 40, 5
LIMIT_S = 60
TRAIN = [a for kv in TINY_GPT + [f"train.steps={STEPS}", f"checkpoint.every={EVERY}",
                                 "mesh.data=2", "mesh.fsdp=2"] for a in ("--set", kv)]
LOST = re.compile(r"lost contact with another process of this 2-process run|another task died")


def _start(run, logs, tag: str) -> list[subprocess.Popen]:
    port = free_port()
    procs = []
    for i in range(2):
        out = open(logs / f"{tag}.{i}.log", "w")
        procs.append(subprocess.Popen(
            jaxmp_cmd("train", *TRAIN, "--run-dir", str(run), "--simulate-devices", "2",
                      "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
                      "--process-id", str(i)),
            cwd=REPO, env=subprocess_env(2), stdout=out, stderr=subprocess.STDOUT))
    return procs


def _complete(run) -> list[int]:
    return [s.step for s in list_steps(run) if s.complete] if (run / "checkpoints").exists() \
        else []


def _lose(run, logs, procs, victim: int, tag: str) -> None:
    """SIGKILL ``victim`` once a checkpoint past the last one exists; the other process must
    exit on its own within LIMIT_S with a clear message."""
    before = _complete(run)[-1] if _complete(run) else 0
    deadline = time.monotonic() + 300
    while not _complete(run) or _complete(run)[-1] < before + EVERY:  # mid-run, saving
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
            (logs / f"{tag}.0.log").read_text()[-3000:]
        time.sleep(0.05)
    procs[victim].send_signal(signal.SIGKILL)
    survivor = procs[1 - victim]
    t0 = time.monotonic()
    try:
        code = survivor.wait(timeout=LIMIT_S)
    except subprocess.TimeoutExpired:
        survivor.kill()
        pytest.fail(f"process {1 - victim} still running {LIMIT_S} s after its peer died")
    print(f"lost process {victim}: the other exited after {time.monotonic() - t0:.1f} s "
          f"with code {code}")
    procs[victim].wait(timeout=30)
    log = (logs / f"{tag}.{1 - victim}.log").read_text()
    assert code != 0 and LOST.search(log) and "Traceback" not in log, log[-3000:]


def test_a_lost_process_ends_the_other_and_both_resume(tmp_path):
    run, logs = tmp_path / "run", tmp_path
    _lose(run, logs, _start(run, logs, "first"), 1, "first")  # a worker
    last = _complete(run)[-1]
    _lose(run, logs, _start(run, logs, "second"), 0, "second")  # the coordinator
    assert f"resuming from checkpoint step {last}" in (logs / "second.0.log").read_text()
    last = _complete(run)[-1]
    assert last < STEPS
    procs = _start(run, logs, "third")
    codes = [p.wait(timeout=300) for p in procs]
    out = (logs / "third.0.log").read_text()
    assert codes == [0, 0], out[-3000:]
    assert f"resuming from checkpoint step {last}" in out
    assert _complete(run)[-1] == STEPS
