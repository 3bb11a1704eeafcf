"""Hugging Face Llama / Mistral / Qwen2 written from their semantics, in numpy, for the import
tests: random checkpoints in HF's layout (config.json + safetensors, one file or a sharded
index) and the models' forward pass. Nothing here calls jaxmp's model, so a mistake in jaxmp's
mapping cannot cancel out."""
from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def make_checkpoint(folder: Path, arch: str, *, vocab: int, d: int, layers: int, heads: int,
                    kv: int, head_dim: int, mlp: int, tied: bool, dtype: str, files: int = 1,
                    theta: float = 10000.0, rope_scaling: dict | None = None,
                    extra: dict | None = None, seed: int = 0,
                    store_tied_head: bool = False) -> dict[str, np.ndarray]:
    """Write a random ``arch`` checkpoint into ``folder``; returns its tensors by name."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    qwen = arch == "Qwen2ForCausalLM"
    shapes = {"model.embed_tokens.weight": (vocab, d), "model.norm.weight": (d,)}
    if not tied or store_tied_head:
        shapes["lm_head.weight"] = (vocab, d)
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                   p + "self_attn.q_proj.weight": (heads * head_dim, d),
                   p + "self_attn.k_proj.weight": (kv * head_dim, d),
                   p + "self_attn.v_proj.weight": (kv * head_dim, d),
                   p + "self_attn.o_proj.weight": (d, heads * head_dim),
                   p + "mlp.gate_proj.weight": (mlp, d), p + "mlp.up_proj.weight": (mlp, d),
                   p + "mlp.down_proj.weight": (d, mlp)}
        if qwen:
            shapes |= {p + "self_attn.q_proj.bias": (heads * head_dim,),
                       p + "self_attn.k_proj.bias": (kv * head_dim,),
                       p + "self_attn.v_proj.bias": (kv * head_dim,)}
    tensors = {}
    for name, shape in shapes.items():
        value = 1 + 0.3 * rng.standard_normal(shape) if name.endswith("norm.weight") else \
            (0.3 if name == "model.embed_tokens.weight" else 0.15) * rng.standard_normal(shape)
        tensors[name] = value.astype(DTYPES[dtype])
    if store_tied_head:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    config = {"architectures": [arch], "model_type": {"LlamaForCausalLM": "llama",
                                                      "MistralForCausalLM": "mistral",
                                                      "Qwen2ForCausalLM": "qwen2"}[arch],
              "vocab_size": vocab, "hidden_size": d, "intermediate_size": mlp,
              "num_hidden_layers": layers, "num_attention_heads": heads,
              "num_key_value_heads": kv, "head_dim": head_dim, "hidden_act": "silu",
              "rms_norm_eps": 1e-6, "rope_theta": theta, "rope_scaling": rope_scaling,
              "tie_word_embeddings": tied, "max_position_embeddings": 256,
              "torch_dtype": dtype, "bos_token_id": 1, "eos_token_id": 2, **(extra or {})}
    if qwen:
        del config["head_dim"]  # Qwen2 derives it from hidden_size / heads
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    names = sorted(tensors)
    if files == 1:
        save_file(tensors, str(folder / "model.safetensors"))
    else:
        weight_map = {}
        for k in range(files):
            part = names[k::files]
            file = f"model-{k + 1:05d}-of-{files:05d}.safetensors"
            save_file({n: tensors[n] for n in part}, str(folder / file))
            weight_map |= {n: file for n in part}
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return tensors


def load_checkpoint(folder: Path) -> dict[str, np.ndarray]:
    """Every tensor of an HF folder (single file or index), with the safetensors package."""
    from safetensors.numpy import load_file

    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        return load_file(folder / "model.safetensors")
    out = {}
    for file in sorted(set(json.loads(index.read_text())["weight_map"].values())):
        out |= load_file(folder / file)
    return out


def inv_frequencies(config: dict, head_dim: int) -> np.ndarray:
    """HF's default rope frequencies, rescaled as ``_compute_llama3_parameters`` does."""
    theta = config.get("rope_theta", 10000.0)
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2).astype(np.float64) / head_dim)
    scaling = config.get("rope_scaling") or {}
    if scaling.get("rope_type", scaling.get("type")) != "llama3":
        return inv
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    wavelen = 2 * np.pi / inv
    scaled = np.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    return np.where(medium, smoothed, scaled)


def forward(w: dict[str, np.ndarray], config: dict, ids: np.ndarray) -> np.ndarray:
    """Logits [n, vocab] of one sequence: HF's eager forward pass, in float32 throughout
    (rotate-half rope, repeat-kv grouped-query attention, RMSNorm in float32, ``x @ W.T``)."""
    w = {k: v.astype(np.float32) for k, v in w.items()}
    d, heads = config["hidden_size"], config["num_attention_heads"]
    kv, eps = config["num_key_value_heads"], np.float32(config["rms_norm_eps"])
    hd = config.get("head_dim") or d // heads
    n = len(ids)
    angles = np.outer(np.arange(n), inv_frequencies(config, hd)).astype(np.float32)
    emb = np.concatenate([angles, angles], axis=-1)
    cos, sin = np.cos(emb), np.sin(emb)  # [n, hd]
    causal = np.tril(np.ones((n, n), bool))

    def rms(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        var = np.mean(x * x, axis=-1, keepdims=True)
        return weight * (x / np.sqrt(var + eps))

    def rotate_half(x: np.ndarray) -> np.ndarray:
        return np.concatenate([-x[..., hd // 2:], x[..., :hd // 2]], axis=-1)

    def proj(x: np.ndarray, name: str, count: int) -> np.ndarray:
        y = x @ w[name + ".weight"].T + w.get(name + ".bias", np.float32(0))
        return y.reshape(n, count, hd).transpose(1, 0, 2)  # [heads, n, hd]

    x = w["model.embed_tokens.weight"][ids]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms(x, w[p + "input_layernorm.weight"])
        q, k, v = (proj(h, p + "self_attn.q_proj", heads), proj(h, p + "self_attn.k_proj", kv),
                   proj(h, p + "self_attn.v_proj", kv))
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = np.repeat(k, heads // kv, axis=0), np.repeat(v, heads // kv, axis=0)  # repeat_kv
        scores = np.where(causal, q @ k.transpose(0, 2, 1) / np.float32(np.sqrt(hd)), -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        attn = (probs @ v).transpose(1, 0, 2).reshape(n, heads * hd)
        x = x + attn @ w[p + "self_attn.o_proj.weight"].T
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        gate = h @ w[p + "mlp.gate_proj.weight"].T
        x = x + ((gate / (1 + np.exp(-gate))) * (h @ w[p + "mlp.up_proj.weight"].T)) \
            @ w[p + "mlp.down_proj.weight"].T
    head = w["model.embed_tokens.weight"] if config["tie_word_embeddings"] else w["lm_head.weight"]
    return rms(x, w["model.norm.weight"]) @ head.T


def greedy(w: dict[str, np.ndarray], config: dict, prompt: list[int], new: int,
           limit: int | None = None) -> list[int]:
    """HF's greedy generation without a cache: argmax of the last position, ``new`` times
    (ids at or above ``limit`` never chosen)."""
    ids = list(prompt)
    for _ in range(new):
        logits = forward(w, config, np.asarray(ids))[-1]
        ids.append(int(np.argmax(logits[:limit])))
    return ids[len(prompt):]


def loss(w: dict[str, np.ndarray], config: dict, inputs: np.ndarray,
         targets: np.ndarray) -> float:
    """Mean next-token cross entropy over a batch of rows."""
    total = 0.0
    for row_in, row_t in zip(inputs, targets):
        logits = forward(w, config, row_in).astype(np.float64)
        top = logits.max(-1, keepdims=True)
        logz = np.log(np.exp(logits - top).sum(-1)) + top[:, 0]
        total += float(np.sum(logz - logits[np.arange(len(row_t)), row_t]))
    return total / targets.size
