"""A Hugging Face Llama / Mistral / Qwen2 folder as a GPT run: its config, then its import.

``jaxmp ckpt import HF_DIR --out RUN`` and ``jaxmp train --init-from HF_DIR`` both come here.
The folder's ``config.json`` fixes the model's architecture (``[model]`` keys from
:func:`jaxmp.checkpoint.hf.model_keys`, applied after the config file and before ``--set``);
``--set`` may change how the model runs (``remat``, ``compute_dtype``, ``param_dtype``, a
vocabulary padded larger) but not what it computes. The import itself is
:func:`jaxmp.checkpoint.hf.import_checkpoint`: the params straight onto the mesh, shard by shard.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax

from jaxmp.checkpoint.hf import Weights, import_checkpoint, model_keys, read_config
from jaxmp.checkpoint.hf.arch import sliding_window
from jaxmp.checkpoint.hf.load import TOKENIZER, warn_sliding_window
from jaxmp.config import config_to_toml, parse_override
from jaxmp.data.tokenizer import load_tokenizer
from jaxmp.errors import ConfigError, DataError
from jaxmp.recipes.gpt import model_gpt_config
from jaxmp.recipes.gpt_config import Config, ModelConfig, load_config

# Without a config file, a run from a pretrained model fine-tunes: the defaults' 3e-3 is a
# from-scratch rate that would wreck the imported weights in a few steps. (Params stay the
# default float32 whatever the files hold: bf16 weights would round away updates that
# small; `--set model.param_dtype=bfloat16` keeps them as stored, e.g. to only sample.)
FINE_TUNING = ("optimizer.lr=2e-5",)
# What the checkpoint's tensors were trained to compute: fixed by config.json.
FIXED = ("layers", "d_model", "heads", "kv_heads", "head_dim", "mlp_dim", "activation",
         "tie_embeddings", "norm_eps", "rope_theta", "rope_scaling", "rope_factor",
         "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_positions",
         "qkv_bias")


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, (int, float)) else f'"{value}"'


def hf_config(hf_dir: str | os.PathLike, path: str | os.PathLike | None = None,
              overrides: Sequence[str] = ()) -> Config:
    """The GPT config of a run started from ``hf_dir``: defaults, the config file ``path``
    (or, without one, :data:`FINE_TUNING`'s learning rate), the model of
    ``hf_dir/config.json``, then ``overrides``. Reads file headers only."""
    where = f"{Path(hf_dir) / 'config.json'}"
    source = read_config(hf_dir)
    keys = model_keys(source, where)
    Weights(hf_dir)  # a folder without readable weights is bad input now, before any device work
    try:
        ModelConfig(**keys)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    for text in overrides:  # before the whole config is checked: this says more
        section, key, value = parse_override(text)
        if (section, key) == ("model", "vocab_size") and isinstance(value, int):
            _check_vocab(value, keys["vocab_size"], hf_dir)
    config = load_config(path, [*(FINE_TUNING if path is None else ()),
                                *(f"model.{k}={_toml(v)}" for k, v in keys.items()),
                                *overrides])
    for key in (k for k in FIXED if k in keys):  # the rope_* factors only with llama3
        if getattr(config.model, key) != keys[key]:
            raise ConfigError(f"model.{key}: {hf_dir} holds a model with {key} = "
                              f"{_toml(keys[key])}, which cannot change on import (got "
                              f"{_toml(getattr(config.model, key))})")
    vocab = config.model.vocab_size
    _check_vocab(vocab, keys["vocab_size"], hf_dir)
    tokenizer = Path(hf_dir) / TOKENIZER
    if tokenizer.is_file():
        tokens = load_tokenizer(tokenizer).get_vocab_size()
        if tokens > vocab:
            raise DataError(f"{tokenizer}: has {tokens} tokens, more than model.vocab_size="
                            f"{vocab} holds")
    return config


def _check_vocab(vocab: int, rows: int, hf_dir: str | os.PathLike) -> None:
    if vocab < rows:
        raise ConfigError(f"model.vocab_size: {vocab} is smaller than the {rows}-token "
                          f"vocabulary of {hf_dir} (set it >= {rows}; larger pads the "
                          f"embedding with zero rows)")


def import_run(hf_dir: str | os.PathLike, out: str | os.PathLike, config: Config, *,
               mesh: jax.sharding.Mesh | None = None, into_existing: bool = False,
               ) -> dict[str, Any]:
    """Import ``hf_dir`` into the run directory ``out`` with ``config`` (from :func:`hf_config`):
    a step-0 checkpoint of the params, config.toml, tokenizer.json. Call on every process."""
    warn_sliding_window(sliding_window(read_config(hf_dir)), str(hf_dir))
    summary = import_checkpoint(hf_dir, out, model_gpt_config(config.model),
                                config_to_toml(config), mesh=mesh, into_existing=into_existing)
    return {**summary, "architecture": read_config(hf_dir)["architectures"][0]}
