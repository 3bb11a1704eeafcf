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

from helpers import write_corpus

TINY = ["--set", "model.layers=2", "--set", "model.d_model=32", "--set", "model.heads=4",
        "--set", "data.seq_len=32", "--set", "train.batch_size=8", "--set", "train.steps=30",
        "--set", "train.eval_every=15", "--set", "logging.every=10", "--set", "optimizer.lr=1e-2",
        "--set", "optimizer.warmup_steps=5"]


def jaxmp(*args: str) -> str:
    return jaxmp_all(args)[0]


def jaxmp_all(*argvs: tuple[str, ...]) -> list[str]:
    """Each argv as its own `jaxmp` process, all started at once (independent commands: a
    process mostly keeps one core busy, so two cores run two side by side); their stdouts."""
    procs = [subprocess.Popen([sys.executable, "-m", "jaxmp.cli", *args], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "XLA_FLAGS": ""}) for args in argvs]
    outs = [p.communicate(timeout=300) for p in procs]
    for args, p, (_, err) in zip(argvs, procs, outs):
        assert p.returncode == 0, (args, err[-3000:])
    return [out for out, _ in outs]


def greedy(run: Path, devices: int) -> tuple[str, ...]:
    return ("sample", str(run), "--simulate-devices", str(devices), "--prompt", "the model",
            "--tokens", "24", "--temperature", "0")


@pytest.mark.slow
def test_prepare_train_sample_on_8_and_1_devices(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", files=8, lines=300)
    data = tmp_path / "data"
    jaxmp("data", "prepare", str(corpus), "--out", str(data), "--tokenizer", "bpe:320",
          "--val-fraction", "0.1")
    vocab = json.loads((data / "meta.json").read_text())["vocab_size"]

    run8, run1 = tmp_path / "run8", tmp_path / "run1"
    jaxmp_all(("train", "--simulate-devices", "8", "--run-dir", str(run8), "--set",
               f"data.source={data}", "--set", "mesh.fsdp=4", "--set", "mesh.tensor=2", *TINY),
              ("train", "--simulate-devices", "1", "--run-dir", str(run1), "--set",
               f"data.source={data}", *TINY))
    for run in (run8, run1):
        metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        assert metrics[-1]["step"] == 30 and metrics[-1]["loss"] < metrics[0]["loss"] - 0.5
        assert "eval_loss" in metrics[-1]
        assert (run / "tokenizer.json").read_bytes() == (data / "tokenizer.json").read_bytes()
        assert f"vocab_size = {-(-vocab // 64) * 64}\n" in (run / "config.toml").read_text()
    assert json.loads((run8 / "plan.json").read_text())["mesh"]["tensor"] == 2

    saved_on_8_sampled_on_1, on_8, saved_on_1_sampled_on_8, on_1, two = jaxmp_all(
        greedy(run8, 1), greedy(run8, 8), greedy(run1, 8), greedy(run1, 1),
        ("sample", str(run8), "--tokens", "16", "--temperature", "1", "--top-k", "20",
         "--seed", "3", "--num-samples", "2"))
    assert saved_on_8_sampled_on_1 == on_8  # and on 8: the same greedy text
    assert saved_on_1_sampled_on_8 == on_1  # saved on 1, sampled on 8 and on 1
    text = saved_on_8_sampled_on_1
    assert text.startswith("the model") and len(text) > len("the model\n") + 10
    learnt = set(text.split()) & {"the", "model", "mesh", "loss", "of", "devices", "over"}
    assert len(learnt) >= 2, text  # 30 steps teach it some of the corpus's words

    first, second = two.split("-" * 40 + "\n")
    assert first.strip() and second.strip() and first != second
