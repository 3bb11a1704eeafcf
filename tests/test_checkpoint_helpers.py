"""Shared pieces of the checkpoint tests (this module holds no tests).

- ``Bigram``: an NNX model with logical names that compiles in ~2 s.
- Environment and helpers for subprocesses (``jaxmp train``, fresh-process restores,
  2-process runs).
"""
from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

REPO = Path(__file__).resolve().parents[1]
JAX_CACHE = os.environ["JAX_COMPILATION_CACHE_DIR"]  # set in conftest.py

TINY_GPT = ["model.layers=2", "model.d_model=32", "model.heads=4", "data.source=synthetic",
            "data.seq_len=16", "train.batch_size=8", "train.eval_every=0", "logging.every=1",
            "logging.progress=false", "logging.tensorboard=false"]


class Bigram(nnx.Module):
    """Embed, then project back to the vocabulary."""

    def __init__(self, vocab: int, d: int, rngs: nnx.Rngs):
        def param(shape, names):
            return nnx.Param(0.02 * jax.random.normal(rngs.params(), shape), out_sharding=names,
                             eager_sharding=False)

        self.embed = param((vocab, d), ("vocab", "embed"))
        self.out = param((d, vocab), ("embed", "vocab"))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return jnp.take(self.embed[...], tokens, axis=0) @ self.out[...]


def subprocess_env(devices: int = 8) -> dict[str, str]:
    # here, not at the top: subprocesses import this module, and conftest sets 8 devices
    from conftest import FAST_COMPILE_FLAGS

    env = dict(os.environ)
    path = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env.update(PYTHONPATH=path,
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE_FLAGS}",
               JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=JAX_CACHE,
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", PYTHONUNBUFFERED="1")
    return env


def jaxmp_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "jaxmp.cli", *args]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
