"""Shared test fixtures: a tiny GPT whose dims divide by 8, a single-device reference, and a
small generated text corpus."""
from __future__ import annotations

import os
import signal
from pathlib import Path

import jax
import numpy as np

from jaxmp.models import GPT, GPTConfig

TINY = GPTConfig(vocab_size=256, layers=2, d_model=64, heads=8, kv_heads=8, head_dim=8,
                 mlp_dim=256)


def gpt_fn(cfg: GPTConfig = TINY):
    return lambda rngs: GPT(cfg, rngs=rngs)


def lm_batch(batch: int = 8, seq: int = 16, vocab: int = 256, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (batch, seq + 1), dtype=np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def one_device():
    return jax.devices()[:1]


def step_collectives(axes: dict, cfg: GPTConfig = TINY, batch: int = 16):
    """Compile one train step of ``cfg`` on ``axes`` (8 devices): (CollectiveStats, param bytes)."""
    import jaxmp
    from jaxmp.hlo import collective_stats
    from jaxmp.models import lm_loss
    from jaxmp._util.arrays import tree_bytes
    from jaxmp.config import OptimizerConfig
    from jaxmp.train.optimizer import make_optimizer, make_schedule
    from jaxmp.train.state import plan_state
    from jaxmp.train.step import make_train_step

    opt = OptimizerConfig()
    tx, sched = make_optimizer(opt, 10), make_schedule(opt, 10)
    layout = plan_state(gpt_fn(cfg), tx, jaxmp.make_mesh(axes))
    example = lm_batch(batch=batch)
    step = make_train_step(layout, lm_loss, tx, sched, example)
    stats = collective_stats(step.lower(layout.abstract, example).compile())
    return stats, tree_bytes(layout.abstract.params)


WORDS = ("the model shards its parameters over a mesh of devices while the loss falls "
         "überall naïve café 東京 🙂 tokens").split()


def write_corpus(root: Path, files: int = 6, lines: int = 60, seed: int = 0) -> Path:
    """Small text files: unicode, CRLF, blank lines, a file without a final newline."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    for f in range(files):
        rows = [" ".join(rng.choice(WORDS, rng.integers(0, 12))) for _ in range(lines)]
        end = "\r\n" if f == 1 else "\n"
        text = end.join(rows) + ("" if f == 2 else end)
        (root / f"doc{f}.txt").write_text(text, encoding="utf-8", newline="")
    return root


class Recorder:
    """Wraps a BatchIterator: records the global step of every batch read, and sends this
    process a signal when batch ``signal_at`` is read (the preemption notice)."""

    def __init__(self, inner, signal_at: int | None = None, sig=signal.SIGTERM):
        self.inner, self.signal_at, self.sig, self.read = inner, signal_at, sig, []

    def __iter__(self):
        return self

    def __next__(self):
        self.read.append(self.inner.step)
        if self.inner.step == self.signal_at:
            os.kill(os.getpid(), self.sig)
        return next(self.inner)

    def get_state(self):
        return self.inner.get_state()

    def set_state(self, state):
        self.inner.set_state(state)
