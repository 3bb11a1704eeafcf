"""Shared test fixtures: a tiny GPT whose dims divide by 8, and a single-device reference."""
from __future__ import annotations

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
