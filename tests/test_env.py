"""jaxmp._util.env: process settings that must be made before JAX starts."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_malloc_arenas_are_capped_unless_the_user_chose():
    """jaxmp train caps glibc's arenas (long runs' host RSS stays flat); a MALLOC_ARENA_MAX the
    user set wins. Run in fresh interpreters: the setting is process-wide."""
    code = "from jaxmp._util.env import limit_malloc_arenas as f; print(f())"
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    capped = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                            text=True, check=True).stdout.strip()
    chosen = subprocess.run([sys.executable, "-c", code], env={**env, "MALLOC_ARENA_MAX": "4"},
                            capture_output=True, text=True, check=True).stdout.strip()
    assert (capped, chosen) == ("True", "False")
