"""Export a jaxmp GPT checkpoint in Hugging Face Llama's layout (``model.safetensors`` +
``config.json``), so other ecosystems load it as a ``LlamaForCausalLM``.

The GPT is a Llama when it uses SwiGLU and an untied output head: its RMSNorm, rotary
embedding, bias-free projections and (optional) grouped-query attention are Llama's already.
The rotary embedding needs no permutation of q/k: jaxmp's :func:`~jaxmp.models.gpt.rope` rotates
the two halves of each head (``[x1·cos − x2·sin, x2·cos + x1·sin]``), which is exactly what HF
Llama's ``rotate_half`` computes on its q_proj/k_proj outputs. (The permutation in HF's
conversion script is for Meta's original interleaved-pair checkpoints.)

Layouts: jaxmp stores ``x @ W`` kernels ``[in, ...out]`` stacked over a leading ``layers`` axis;
HF stores ``nn.Linear`` weights ``[out, in]`` per layer, with heads flattened head-major. Each
stored array is read once and written as its per-layer slices, one array in memory at a time.
"""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from jaxmp._util.io import atomic_write
from jaxmp.checkpoint import store
from jaxmp.checkpoint.inspect import write_safetensors
from jaxmp.errors import CheckpointError

ROPE_THETA = 10000.0  # jaxmp.models.gpt.rope's base

# jaxmp param path → (HF name, with {i} for the layer; stacked over layers?; stored → HF layout)
_LAYOUT: dict[str, tuple[str, Callable[[np.ndarray], np.ndarray]]] = {
    "embed": ("model.embed_tokens.weight", lambda a: a),
    "blocks/attn_norm/scale": ("model.layers.{i}.input_layernorm.weight", lambda a: a),
    "blocks/attn/q": ("model.layers.{i}.self_attn.q_proj.weight",
                      lambda a: a.reshape(a.shape[0], -1).T),
    "blocks/attn/k": ("model.layers.{i}.self_attn.k_proj.weight",
                      lambda a: a.reshape(a.shape[0], -1).T),
    "blocks/attn/v": ("model.layers.{i}.self_attn.v_proj.weight",
                      lambda a: a.reshape(a.shape[0], -1).T),
    "blocks/attn/o": ("model.layers.{i}.self_attn.o_proj.weight",
                      lambda a: a.reshape(-1, a.shape[-1]).T),
    "blocks/mlp_norm/scale": ("model.layers.{i}.post_attention_layernorm.weight", lambda a: a),
    "blocks/mlp/gate": ("model.layers.{i}.mlp.gate_proj.weight", lambda a: a.T),
    "blocks/mlp/up": ("model.layers.{i}.mlp.up_proj.weight", lambda a: a.T),
    "blocks/mlp/down": ("model.layers.{i}.mlp.down_proj.weight", lambda a: a.T),
    "final_norm/scale": ("model.norm.weight", lambda a: a),
    "unembed": ("lm_head.weight", lambda a: a.T),
}
# What makes a GPT a Llama: (config key, Llama's value, value without the array that shows it)
_REQUIRED = {"activation": ("swiglu", "gelu", "blocks/mlp/gate"),
             "tie_embeddings": (False, True, "unembed")}


def _run_config(step_dir: Path) -> dict[str, Any]:
    """The config saved with the checkpoint (empty for checkpoints saved without one)."""
    run = store.read_json(step_dir, "run", missing_ok=True) or {}
    return tomllib.loads(run["config_toml"]) if run.get("config_toml") else {}


def _check_llama(records: Mapping[str, Any], model: Mapping[str, Any], step_dir: Path) -> None:
    """CheckpointError naming the first config field in which the GPT is not a Llama."""
    for key, (want, other, array) in _REQUIRED.items():
        have = model.get(key, want if array in records else other)
        if have != want:
            raise CheckpointError(
                f"cannot export as Llama: model.{key} is {json.dumps(have)} but Llama needs "
                f"{json.dumps(want)} (train with --set model.{key}={str(want).lower()})")
    missing = [p for p in _LAYOUT if p not in records]
    if missing:
        raise CheckpointError(f"checkpoint {step_dir} is not a jaxmp GPT: it has no "
                              f"params/{missing[0]}")


def llama_config(records: Mapping[str, Any], model: Mapping[str, Any],
                 max_positions: int) -> dict[str, Any]:
    """HF ``config.json`` for the GPT whose arrays are ``records`` (shapes are the truth)."""
    layers, d_model, heads, head_dim = records["blocks/attn/q"]["shape"]
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": records["embed"]["shape"][0], "hidden_size": d_model,
        "intermediate_size": records["blocks/mlp/up"]["shape"][-1],
        "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": records["blocks/attn/k"]["shape"][2], "head_dim": head_dim,
        "hidden_act": "silu", "rms_norm_eps": float(model.get("norm_eps", 1e-5)),
        "rope_theta": ROPE_THETA, "rope_scaling": None, "max_position_embeddings": max_positions,
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
        "initializer_range": float(model.get("init_std", 0.02)),
        "torch_dtype": records["embed"]["dtype"], "use_cache": True,
    }


def export_llama(path: str | os.PathLike, out: str | os.PathLike,
                 step: int | None = None) -> dict[str, Any]:
    """Write ``out/model.safetensors`` and ``out/config.json`` (and the run's tokenizer.json)."""
    ckdir, step = store.locate(path, step)
    step_dir = ckdir / str(step)
    stored = store.read_meta(step_dir)["arrays"]
    prefix = "params/" if any(p.startswith("params/") for p in stored) else ""
    records = {p[len(prefix):]: r for p, r in stored.items() if p.startswith(prefix)}
    config = _run_config(step_dir)
    model = config.get("model", {})
    _check_llama(records, model, step_dir)
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"--out {out}: exists and is not a folder")
    out.mkdir(parents=True, exist_ok=True)
    layers = records["blocks/attn/q"]["shape"][0]

    tensors = []
    for path_, (name, to_hf) in _LAYOUT.items():
        rec = records[path_]
        shape = to_hf(np.empty(rec["shape"][1:] if path_.startswith("blocks/")
                               else rec["shape"], np.bool_)).shape
        names = [name.format(i=i) for i in range(layers)] if path_.startswith("blocks/") \
            else [name]
        tensors += [(n, rec["dtype"], shape) for n in names]

    def arrays() -> Iterator[np.ndarray]:
        for path_, (_, to_hf) in _LAYOUT.items():
            a = store.read_numpy(step_dir, prefix + path_, records[path_])
            for layer in (a if path_.startswith("blocks/") else [a]):
                yield np.ascontiguousarray(to_hf(layer))

    size = write_safetensors(out / "model.safetensors", tensors, arrays(),
                             {"format": "pt", "jaxmp_step": str(step)})
    hf_config = llama_config(records, model, int(config.get("data", {}).get("seq_len", 2048)))
    atomic_write(out / "config.json", json.dumps(hf_config, indent=2) + "\n")
    run_dir = ckdir.parent if ckdir.name == "checkpoints" else ckdir
    if (run_dir / "tokenizer.json").is_file():
        atomic_write(out / "tokenizer.json", (run_dir / "tokenizer.json").read_bytes())
    return {"step": step, "out": str(out), "tensors": len(tensors), "bytes": size}
