"""Your own text to samples, as a user runs it: `jaxmp data prepare` → `jaxmp train` (30 steps)
→ `jaxmp sample`, with the checkpoint saved on 8 simulated devices and sampled on 1, and the
reverse. Each command is a fresh process, as on the command line."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FAST_COMPILE_FLAGS
from helpers import write_corpus

TINY = ["--set", "model.layers=2", "--set", "model.d_model=32", "--set", "model.heads=4",
        "--set", "data.seq_len=32", "--set", "train.batch_size=8", "--set", "train.steps=30",
        "--set", "train.eval_every=15", "--set", "logging.every=10", "--set", "optimizer.lr=1e-2",
        "--set", "optimizer.warmup_steps=5"]


def jaxmp(*args: str) -> str:
    r = subprocess.run([sys.executable, "-m", "jaxmp.cli", *args], capture_output=True, text=True,
                       timeout=300, env={**os.environ, "XLA_FLAGS": FAST_COMPILE_FLAGS})
    assert r.returncode == 0, (args, r.stderr[-3000:])
    return r.stdout


def greedy(run: Path, devices: int) -> str:
    return jaxmp("sample", str(run), "--simulate-devices", str(devices), "--prompt", "the model",
                 "--tokens", "24", "--temperature", "0")


@pytest.mark.slow
def test_prepare_train_sample_on_8_and_1_devices(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", files=8, lines=300)
    data = tmp_path / "data"
    jaxmp("data", "prepare", str(corpus), "--out", str(data), "--tokenizer", "bpe:320",
          "--val-fraction", "0.1")
    vocab = json.loads((data / "meta.json").read_text())["vocab_size"]

    run8, run1 = tmp_path / "run8", tmp_path / "run1"
    jaxmp("train", "--simulate-devices", "8", "--run-dir", str(run8), "--set",
          f"data.source={data}", "--set", "mesh.fsdp=4", "--set", "mesh.tensor=2", *TINY)
    jaxmp("train", "--simulate-devices", "1", "--run-dir", str(run1), "--set",
          f"data.source={data}", *TINY)
    for run in (run8, run1):
        metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        assert metrics[-1]["step"] == 30 and metrics[-1]["loss"] < metrics[0]["loss"] - 0.5
        assert "eval_loss" in metrics[-1]
        assert (run / "tokenizer.json").read_bytes() == (data / "tokenizer.json").read_bytes()
        assert f"vocab_size = {-(-vocab // 64) * 64}\n" in (run / "config.toml").read_text()
    assert json.loads((run8 / "plan.json").read_text())["mesh"]["tensor"] == 2

    saved_on_8_sampled_on_1 = greedy(run8, 1)
    assert saved_on_8_sampled_on_1 == greedy(run8, 8)  # and on 8: the same greedy text
    assert greedy(run1, 8) == greedy(run1, 1)  # saved on 1, sampled on 8 and on 1
    text = saved_on_8_sampled_on_1
    assert text.startswith("the model") and len(text) > len("the model\n") + 10
    learnt = set(text.split()) & {"the", "model", "mesh", "loss", "of", "devices", "over"}
    assert len(learnt) >= 2, text  # 30 steps teach it some of the corpus's words

    two = jaxmp("sample", str(run8), "--tokens", "16", "--temperature", "1", "--top-k", "20",
                "--seed", "3", "--num-samples", "2")
    first, second = two.split("-" * 40 + "\n")
    assert first.strip() and second.strip() and first != second
