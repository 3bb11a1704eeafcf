"""scripts/chaos.py in small (3 kills): `jaxmp train` SIGKILLed at random moments (start-up, mid-step,
mid-save, the first save) and restarted ends bit for bit where an uninterrupted run ends.
docs/reliability.md records the K=20 runs."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from test_checkpoint_helpers import REPO, subprocess_env

pytestmark = pytest.mark.slow


def test_killed_at_random_moments_then_resumed_is_bitwise_identical(tmp_path):
    env = subprocess_env(1)
    env.pop("XLA_FLAGS")  # chaos.py gives each run its own simulated devices
    out = subprocess.run([sys.executable, "scripts/chaos.py", "--kills", "3", "--steps", "20",
                          "--simulate-devices", "2", "--out", str(tmp_path), "--json"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    report = json.loads(out.stdout)
    assert out.returncode == 0 and report["passed"], out.stdout[-4000:]
    assert report["kills_landed"] >= 2 and report["by_kind"]["first-save"] == 1
    assert report["arrays_equal"] == report["arrays"] > 20  # params, optimizer state, the rest
    assert report["resumes_ok"] == report["restarts_judged"] >= 1
    assert report["losses_equal"] == 20 and report["metric_lines_broken"] == 0
