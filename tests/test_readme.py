"""The README's examples run and print what they claim: "use the rules in your own code" and
"your own data"."""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

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


@pytest.mark.slow
def test_your_own_data_commands_run_as_written(tmp_path):
    """The "Your own data" block: prepare → train → sample, exactly as printed, run from a copy
    of the files it names."""
    text = README.read_text()
    section = text[text.index("## Your own data"):]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    commands = [shlex.split(line) for line in block.splitlines() if line.strip()]
    assert [c[:2] for c in commands] == [["jaxmp", "data"], ["jaxmp", "train"], ["jaxmp", "sample"]]
    shutil.copytree(README.parent / "docs", tmp_path / "docs")
    shutil.copy(README, tmp_path / "README.md")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    outputs = []
    for cmd in commands:
        r = subprocess.run([sys.executable, "-m", "jaxmp.cli", *cmd[1:]], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, (cmd, r.stderr[-2000:])
        outputs.append(r.stdout)
    meta = json.loads((tmp_path / "data" / "docs" / "meta.json").read_text())
    assert meta["tokenizer"] == "bpe:1024" and len(meta["sources"]) >= 5
    run = tmp_path / "runs" / "docs"
    assert (run / "tokenizer.json").is_file() and "vocab_size = 1024\n" in (
        run / "config.toml").read_text()
    losses = [json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert losses[-1] < losses[0] - 1
    assert outputs[2].startswith("The planner") and len(outputs[2]) > 100
