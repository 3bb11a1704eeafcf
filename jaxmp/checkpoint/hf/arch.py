"""Llama, Mistral and Qwen2 in Hugging Face's terms ⇄ jaxmp's GPT: config keys and tensors.

All three are the GPT with SwiGLU, RMSNorm and rotary embeddings: Mistral is Llama's layout
(its sliding window aside), Qwen2 adds biases to the q/k/v projections. The rotary embedding
needs no permutation of q/k: jaxmp's :func:`~jaxmp.models.gpt.rope` rotates the two halves of
each head, which is what HF's ``rotate_half`` computes (the permutation in HF's conversion
script is for Meta's original interleaved-pair checkpoints).

Layouts: jaxmp stores ``x @ W`` kernels ``[in..., out...]`` stacked over a leading ``layers``
axis; HF stores ``nn.Linear`` weights ``[out, in]`` per layer with heads flattened head-major.
:class:`Layout` converts one tensor either way; the import only ever takes *views* of a
memory-mapped HF tensor (a transpose and a reshape that splits a dim are views), so a device
reads just its slice.

This module knows no recipe: HF ``config.json`` becomes a dict of jaxmp ``[model]`` keys,
and a run's ``[model]`` table (a dict) becomes HF's ``config.json``.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from jaxmp.errors import CheckpointError

ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                 "Qwen2ForCausalLM": "qwen2"}
ROPE_TYPES = ("default", "llama3")
IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")  # buffers some old checkpoints carry


@dataclass(frozen=True)
class Layout:
    """One GPT param and its HF tensor (``{i}``: the layer of a stacked param).

    ``kind``: ``linear`` (jaxmp ``[in..., out...]`` with ``in_dims`` input dims ⇄ HF
    ``[out, in]``), ``flat`` (a bias: jaxmp ``[heads, head_dim]`` ⇄ HF ``[heads·head_dim]``)
    or ``copy``. ``vocab_axis``: the jaxmp dim that is the vocabulary, which may be padded
    past the HF tensor's (the extra rows are zeros).
    """

    path: str
    name: str
    kind: str = "copy"
    in_dims: int = 1
    vocab_axis: int | None = None

    @property
    def stacked(self) -> bool:
        return self.path.startswith("blocks/")

    def hf_name(self, layer: int | None = None) -> str:
        return self.name.format(i=layer)

    def hf_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        """The HF shape of a jaxmp (per-layer) shape."""
        if self.kind == "linear":
            return math.prod(shape[self.in_dims:]), math.prod(shape[:self.in_dims])
        return (math.prod(shape),) if self.kind == "flat" else tuple(shape)

    def hf_vocab_axis(self) -> int | None:
        if self.vocab_axis is None:
            return None
        return 1 - self.vocab_axis if self.kind == "linear" else self.vocab_axis

    def to_jaxmp(self, w: np.ndarray, shape: Sequence[int]) -> np.ndarray:
        """HF tensor → jaxmp layout of ``shape``, as a view when ``w`` allows one."""
        return (w.T if self.kind == "linear" else w).reshape(tuple(shape))

    def to_hf(self, a: np.ndarray) -> np.ndarray:
        """jaxmp (per-layer) array → the HF tensor."""
        if self.kind == "linear":
            return a.reshape(math.prod(a.shape[:self.in_dims]), -1).T
        return a.reshape(-1) if self.kind == "flat" else a


_LAYER = "model.layers.{i}."
LAYOUTS = (
    Layout("embed", "model.embed_tokens.weight", vocab_axis=0),
    Layout("blocks/attn_norm/scale", _LAYER + "input_layernorm.weight"),
    Layout("blocks/attn/q", _LAYER + "self_attn.q_proj.weight", "linear"),
    Layout("blocks/attn/k", _LAYER + "self_attn.k_proj.weight", "linear"),
    Layout("blocks/attn/v", _LAYER + "self_attn.v_proj.weight", "linear"),
    Layout("blocks/attn/q_bias", _LAYER + "self_attn.q_proj.bias", "flat"),
    Layout("blocks/attn/k_bias", _LAYER + "self_attn.k_proj.bias", "flat"),
    Layout("blocks/attn/v_bias", _LAYER + "self_attn.v_proj.bias", "flat"),
    Layout("blocks/attn/o", _LAYER + "self_attn.o_proj.weight", "linear", in_dims=2),
    Layout("blocks/mlp_norm/scale", _LAYER + "post_attention_layernorm.weight"),
    Layout("blocks/mlp/gate", _LAYER + "mlp.gate_proj.weight", "linear"),
    Layout("blocks/mlp/up", _LAYER + "mlp.up_proj.weight", "linear"),
    Layout("blocks/mlp/down", _LAYER + "mlp.down_proj.weight", "linear"),
    Layout("final_norm/scale", "model.norm.weight"),
    Layout("unembed", "lm_head.weight", "linear", vocab_axis=1),
)


def layouts_for(paths: Sequence[str]) -> list[Layout]:
    """The layouts of a GPT's params (``paths`` relative to ``params``), in HF's order."""
    known = {lay.path: lay for lay in LAYOUTS}
    unknown = [p for p in paths if p not in known]
    if unknown:
        raise CheckpointError(f"the GPT param {unknown[0]} has no Hugging Face Llama-family "
                              f"counterpart")
    return [lay for lay in LAYOUTS if lay.path in set(paths)]


# ------------------------------------------------------------------------- config.json → jaxmp


def read_config(folder: str | Path) -> dict[str, Any]:
    path = Path(folder) / "config.json"
    if not Path(folder).is_dir():
        raise CheckpointError(f"{folder}: not a folder (expected a Hugging Face model folder)")
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{folder}: has no config.json (not a Hugging Face model "
                              f"folder)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read: {' '.join(str(e).split())}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: is not a JSON object")
    return config


def architecture(config: Mapping[str, Any], where: str) -> str:
    """``llama`` | ``mistral`` | ``qwen2`` for a config.json (CheckpointError otherwise)."""
    names = config.get("architectures")
    name = names[0] if isinstance(names, list) and len(names) == 1 else names
    if name not in ARCHITECTURES:
        raise CheckpointError(f"{where}: architecture {name!r} cannot be imported; jaxmp maps "
                              f"{', '.join(ARCHITECTURES)}")
    return ARCHITECTURES[name]


def _number(config: Mapping[str, Any], key: str, where: str, kind: type = int,
            default: Any = None) -> Any:
    value = config.get(key)
    if value is None:
        if default is None:
            raise CheckpointError(f"{where}: has no {key}")
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            (kind is int and not isinstance(value, int)):
        raise CheckpointError(f"{where}: {key} is {value!r}, expected "
                              f"{'an integer' if kind is int else 'a number'}")
    return kind(value)


def _rope(config: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``rope_theta`` and ``rope_scaling`` (transformers 4 keys, or 5's ``rope_parameters``)."""
    params = config.get("rope_parameters")
    params = params if isinstance(params, dict) else {}
    scaling = config.get("rope_scaling") or params or {}
    if not isinstance(scaling, dict):
        raise CheckpointError(f"{where}: rope_scaling is {scaling!r}, expected a table or null")
    theta = _number({**params, **config}, "rope_theta", where, float, 10000.0)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise CheckpointError(f"{where}: rope_scaling type {kind!r} is not supported; jaxmp "
                              f"maps {', '.join(repr(t) for t in ROPE_TYPES)}")
    keys: dict[str, Any] = {"rope_theta": theta, "rope_scaling": "none"}
    if kind == "llama3":
        where = f"{where} rope_scaling"
        keys.update(rope_scaling="llama3",
                    rope_factor=_number(scaling, "factor", where, float),
                    rope_low_freq_factor=_number(scaling, "low_freq_factor", where, float),
                    rope_high_freq_factor=_number(scaling, "high_freq_factor", where, float),
                    rope_original_max_positions=_number(
                        scaling, "original_max_position_embeddings", where))
    return keys


def model_keys(config: Mapping[str, Any], where: str) -> dict[str, Any]:
    """jaxmp ``[model]`` keys of a Llama / Mistral / Qwen2 ``config.json``.

    Anything these models may hold that the GPT would compute differently is refused by
    name (another activation, an o_proj or MLP bias, another rope scaling)."""
    arch = architecture(config, where)
    act = config.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise CheckpointError(f"{where}: hidden_act {act!r} is not supported (jaxmp's SwiGLU "
                              f"uses silu)")
    for key in ("attention_bias", "mlp_bias"):
        if arch != "qwen2" and config.get(key):
            raise CheckpointError(f"{where}: {key} true is not supported (jaxmp's GPT has no "
                                  f"{'o_proj' if key == 'attention_bias' else 'MLP'} bias)")
    d = _number(config, "hidden_size", where)
    heads = _number(config, "num_attention_heads", where)
    if heads < 1 or d < 1:
        raise CheckpointError(f"{where}: hidden_size {d} / num_attention_heads {heads} must "
                              f"be >= 1")
    head_dim = _number(config, "head_dim", where, default=d // heads)
    return {"layers": _number(config, "num_hidden_layers", where), "d_model": d,
            "heads": heads, "kv_heads": _number(config, "num_key_value_heads", where,
                                                default=heads),
            "head_dim": head_dim, "mlp_dim": _number(config, "intermediate_size", where),
            "vocab_size": _number(config, "vocab_size", where), "activation": "swiglu",
            "tie_embeddings": bool(config.get("tie_word_embeddings", False)),
            "norm_eps": _number(config, "rms_norm_eps", where, float, 1e-6),
            "init_std": _number(config, "initializer_range", where, float, 0.02),
            "qkv_bias": arch == "qwen2", **_rope(config, where)}


def sliding_window(config: Mapping[str, Any]) -> int | None:
    """The attention window a Mistral / Qwen2 config uses, if any (jaxmp attends to all)."""
    window = config.get("sliding_window")
    if config.get("use_sliding_window") is False or not isinstance(window, int):
        return None
    return window


# ------------------------------------------------------------------------- jaxmp → config.json


def choose_architecture(wanted: str, base: Mapping[str, Any] | None, has_bias: bool) -> str:
    """The HF class to export as: ``wanted``, else the imported one, else by the biases."""
    if wanted == "auto":
        names = (base or {}).get("architectures") or []
        wanted = names[0] if names and names[0] in ARCHITECTURES else \
            ("Qwen2ForCausalLM" if has_bias else "LlamaForCausalLM")
    if wanted not in ARCHITECTURES:
        raise CheckpointError(f"--architecture {wanted!r}: expected auto or one of "
                              f"{', '.join(ARCHITECTURES)}")
    if (ARCHITECTURES[wanted] == "qwen2") != has_bias:
        raise CheckpointError(
            f"cannot export as {wanted}: " + ("Qwen2 has q/k/v biases and this GPT has none "
                                              "(model.qkv_bias is false)" if not has_bias else
                                              "this GPT has q/k/v biases (model.qkv_bias), "
                                              "which only Qwen2ForCausalLM holds"))
    return wanted


def hf_config(arch: str, model: Mapping[str, Any], shapes: Mapping[str, Sequence[int]],
              dtype: str, base: Mapping[str, Any] | None, max_positions: int) -> dict[str, Any]:
    """HF ``config.json`` for the GPT whose param shapes are ``shapes`` (shapes are the truth;
    ``model`` is the run's ``[model]`` table; ``base`` the imported config.json, whose other
    keys — token ids, context length — are kept)."""
    layers, d_model, heads, head_dim = shapes["blocks/attn/q"]
    llama3 = model.get("rope_scaling", "none") == "llama3"
    out = {k: v for k, v in (base or {}).items() if k not in ("rope_parameters", "dtype")}
    out.update({
        "architectures": [arch], "model_type": ARCHITECTURES[arch],
        "vocab_size": shapes["embed"][0], "hidden_size": d_model,
        "intermediate_size": shapes["blocks/mlp/up"][-1], "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": shapes["blocks/attn/k"][2],
        "head_dim": head_dim, "hidden_act": "silu",
        "rms_norm_eps": float(model.get("norm_eps", 1e-5)),
        "rope_theta": float(model.get("rope_theta", 10000.0)),
        "rope_scaling": {"rope_type": "llama3", "factor": float(model["rope_factor"]),
                         "low_freq_factor": float(model["rope_low_freq_factor"]),
                         "high_freq_factor": float(model["rope_high_freq_factor"]),
                         "original_max_position_embeddings":
                             int(model["rope_original_max_positions"])} if llama3 else None,
        "tie_word_embeddings": "unembed" not in shapes, "torch_dtype": dtype})
    out.setdefault("max_position_embeddings", max_positions)
    out.setdefault("initializer_range", float(model.get("init_std", 0.02)))
    out.setdefault("use_cache", True)
    if ARCHITECTURES[arch] == "llama":
        out.update(attention_bias=False, mlp_bias=False)
    else:
        out.setdefault("sliding_window", None)
    if ARCHITECTURES[arch] == "qwen2":
        out.setdefault("use_sliding_window", False)
        out.setdefault("max_window_layers", layers)
    return out
