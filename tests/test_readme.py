"""The README's "use the rules in your own code" example runs and prints what it claims."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_rules_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    example = next(b for b in blocks if "rules.specs_for" in b)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    r = subprocess.run([sys.executable, "-c", example], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    claimed = re.findall(r"print\(.*?\)\s*# (P\(.*?\))\n", example)
    assert len(claimed) == 2
    for c in claimed:
        assert c in r.stdout, (c, r.stdout)
    assert "replicated" in r.stdout.lower()
