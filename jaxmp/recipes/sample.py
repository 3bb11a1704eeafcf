"""``jaxmp sample``: a GPT run's checkpoint, restored on the devices present, generating text.

The run is self-contained: the model comes from the config saved with the checkpoint (the
run's ``config.toml`` for checkpoints without one), the tokenizer from the run directory
(copied there when training on a prepared folder; raw bytes otherwise). Parameters are restored
through :func:`jaxmp.checkpoint.restore`, so they are sharded by the same rules on any mesh,
and decoding is :func:`jaxmp.models.decode.generate` — one jitted loop with a KV cache.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from jaxmp import checkpoint
from jaxmp._util.log import say
from jaxmp.checkpoint import store
from jaxmp.data.meta import TOKENIZER
from jaxmp.data.tokenizer import EOT, Codec
from jaxmp.errors import CheckpointError, ConfigError, DataError
from jaxmp.mesh import make_mesh
from jaxmp.models import GPT
from jaxmp.models.decode import generate
from jaxmp.recipes.gpt import model_gpt_config
from jaxmp.recipes.gpt_config import ModelConfig


@dataclass
class Sampler:
    """A restored GPT with its tokenizer: ``sample(prompt, ...)`` returns texts."""

    model: GPT
    codec: Codec
    step: int
    seq_len: int | None  # the context length the run trained on (None if unknown)

    @classmethod
    def load(cls, path: str | os.PathLike, step: int | None = None,
             mesh: jax.sharding.Mesh | None = None) -> Sampler:
        """Restore ``path`` (a run directory, its checkpoints/ folder or a step directory)."""
        ckdir, step = store.locate(path, step)
        run_dir = ckdir.parent if ckdir.name == "checkpoints" else ckdir
        config = _run_config(ckdir, step, run_dir)
        try:
            model_config = ModelConfig(**config.get("model", {}))
        except TypeError as e:
            raise ConfigError(f"the config of {ckdir / str(step)} has a [model] section this "
                              f"version cannot read: {e}") from None
        cfg = model_gpt_config(model_config)
        mesh = mesh if mesh is not None else make_mesh({"fsdp": -1})
        params = checkpoint.restore(ckdir / str(step), mesh=mesh)
        graphdef, state = nnx.split(nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0))))
        try:
            nnx.replace_by_pure_dict(state, params)
        except (KeyError, ValueError) as e:
            raise CheckpointError(f"checkpoint {ckdir / str(step)} does not hold the GPT of its "
                                  f"config: {' '.join(str(e).split())[:200]}") from None
        codec, data = Codec.for_run(run_dir), config.get("data", {})
        if codec.tokenizer is None and cfg.vocab_size > codec.vocab_size and \
                str(data.get("source", "")).endswith(".bin"):
            raise DataError(f"{run_dir} has no {TOKENIZER} and its model (vocab {cfg.vocab_size},"
                            f" trained on {data['source']}) is not byte-level: copy the "
                            f"tokenizer.json that made the .bin file into {run_dir}")
        return cls(nnx.merge(graphdef, state), codec, step, data.get("seq_len"))

    def prompt_ids(self, prompt: str) -> list[int]:
        """The prompt's ids; an empty prompt starts at a document boundary."""
        if prompt:
            return self.codec.encode(prompt)
        if self.codec.separator is None:
            raise DataError("--prompt is empty and the run's tokenizer has no end-of-text token "
                            "to start from; give a prompt")
        return [self.codec.separator]

    def sample(self, prompt: str = "", tokens: int = 200, temperature: float = 0.8,
               top_k: int | None = None, seed: int = 0, num_samples: int = 1) -> list[str]:
        """``num_samples`` continuations of ``prompt`` (prompt included), as text."""
        _check(tokens >= 1, "--tokens", "must be >= 1", tokens)
        _check(temperature >= 0, "--temperature", "must be >= 0 (0 = greedy)", temperature)
        _check(num_samples >= 1, "--num-samples", "must be >= 1", num_samples)
        vocab = self.model.cfg.vocab_size
        _check(top_k is None or 1 <= top_k <= vocab, "--top-k", f"must be in [1, {vocab}]", top_k)
        ids = self.prompt_ids(prompt)
        if self.seq_len and len(ids) + tokens > self.seq_len:
            say(f"jaxmp: note: {len(ids)} prompt + {tokens} new tokens run past the "
                f"{self.seq_len}-token context this model was trained on")
        out = generate(self.model, np.array([ids] * num_samples, np.int32), jax.random.key(seed),
                       tokens, temperature=temperature, top_k=top_k,
                       vocab_limit=min(self.codec.vocab_size, vocab))
        return [prompt + self.text(row) for row in np.asarray(out).tolist()]

    def text(self, ids: list[int]) -> str:
        """Decoded ids, each document boundary shown as ``<|endoftext|>``."""
        parts, sep = [[]], self.codec.separator
        for i in ids:
            parts.append([]) if i == sep else parts[-1].append(i)
        return EOT.join(self.codec.decode(p) for p in parts)


def _check(ok: bool, flag: str, why: str, value: object) -> None:
    if not ok:
        raise DataError(f"{flag}: {why}, got {value!r}")


def _run_config(ckdir: Path, step: int, run_dir: Path) -> dict:
    """The config TOML saved with the checkpoint, else the run directory's config.toml."""
    run = checkpoint.info(ckdir, step).get("run") or {}
    text = run.get("config_toml")
    if text is None and (run_dir / "config.toml").is_file():
        text = (run_dir / "config.toml").read_text()
    if text is None:
        raise CheckpointError(f"checkpoint {ckdir / str(step)} has no config and {run_dir} no "
                              f"config.toml: cannot rebuild the model")
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"the config of {ckdir / str(step)}: invalid TOML: {e}") from None
