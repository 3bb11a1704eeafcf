"""Which attention kernel the GPT runs: XLA's, or cuDNN's fused (flash) attention on NVIDIA GPUs.

XLA's attention materialises the ``S x S`` scores and probabilities, and the backward pass keeps
the probabilities: at sequence 8192 that is most of a layer's activation memory. cuDNN's flash
attention (``jax.nn.dot_product_attention(..., implementation="cudnn")``) computes them tile by
tile and keeps only the output and one float32 softmax statistic per query row. It runs only on
NVIDIA GPUs, in bfloat16 / float16, for head dims cuDNN supports, which is what
:func:`choose_attention` checks. The rule lives here so that the recipe (and the planner, which
must know whether ``S x S`` arrays exist) ask the same question.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxmp.config import ATTENTION_KINDS
from jaxmp.errors import ConfigError
from jaxmp.remat import recomputes_attention
from jaxmp.sharding.activations import local, local_specs

SETTINGS = ("auto", *ATTENTION_KINDS)
CUDNN_DTYPES = ("bfloat16", "float16")
# jax checks head_dim <= 128 (<= 256 on Hopper) against the *local* backend, so a deviceless
# compile for an H100 on a CPU host only accepts 128: the portable limit.
CUDNN_MAX_HEAD_DIM = 128
# jax's cuDNN attention partitions itself (custom partitioning) from its operands'
# PartitionSpecs; inside a shard_map over part of the mesh (the pipeline's over ``stage``, the
# gradient reducer's over ``data``; the other axes automatic) XLA hands it shardings without
# one and the compile fails (jax 0.10.2 and 0.12: "'GSPMDSharding' object has no attribute
# 'spec'"). :func:`attend` therefore runs it in a shard_map of its own over the axes still
# automatic (jaxmp.sharding.activations.local), where it sees local arrays and partitions
# nothing: batch split as ``batch``, heads as ``act_heads`` / ``act_kv_heads``, the sequence
# and head_dim whole.
QUERY_NAMES = ("batch", None, "act_heads", None)
KV_NAMES = ("batch", None, "act_kv_heads", None)


@dataclass(frozen=True)
class AttentionChoice:
    """The implementation the model is built with, and why (for the run's start-up line)."""

    implementation: str  # "xla" | "cudnn"
    reason: str

    def __str__(self) -> str:
        return f"attention {self.implementation} ({self.reason})"


def device_platform(device: Any) -> str:
    """``"cuda"`` for an NVIDIA GPU (JAX calls CUDA and ROCm devices both ``"gpu"``), ``"rocm"``
    for an AMD one, else JAX's platform name (``"cpu"``, ``"tpu"``). Works on the device
    descriptions of a deviceless topology too."""
    platform = str(device.platform).lower()
    if platform in ("gpu", "cuda", "rocm"):
        amd = platform == "rocm" or str(device.device_kind).upper().startswith("AMD")
        return "rocm" if amd else "cuda"
    return platform


def cudnn_blocker(platform: str, compute_dtype: str, head_dim: int) -> str | None:
    """Why cuDNN's flash attention cannot run this model on ``platform``, or None if it can."""
    if platform != "cuda":
        return f"no cuDNN on the {platform} backend"
    if compute_dtype not in CUDNN_DTYPES:
        return f"cuDNN's flash attention computes in bfloat16 or float16, not {compute_dtype}"
    if head_dim % 8 or head_dim > CUDNN_MAX_HEAD_DIM:
        return (f"head_dim {head_dim}: cuDNN needs a multiple of 8 up to "
                f"{CUDNN_MAX_HEAD_DIM}")
    return None


def choose_attention(setting: str, platform: str, compute_dtype: str,
                     head_dim: int) -> AttentionChoice:
    """Resolve ``model.attention`` for a model running on ``platform`` (:func:`device_platform`).

    ``"auto"`` takes cuDNN's flash attention wherever it applies (an NVIDIA GPU, 16-bit compute,
    a supported head dim; causal and grouped-query attention are both supported) and XLA's
    elsewhere. ``"cudnn"`` where it cannot run is bad input: it would fail at compile time.
    """
    if setting not in SETTINGS:
        raise ConfigError(f"model.attention: expected one of {', '.join(SETTINGS)}, "
                          f"got {setting!r}")
    if setting == "xla":
        return AttentionChoice("xla", "configured")
    blocker = cudnn_blocker(platform, compute_dtype, head_dim)
    if setting == "cudnn":
        if blocker:
            raise ConfigError(f"model.attention: 'cudnn' cannot run here: {blocker} "
                              f"(use 'auto' or 'xla')")
        return AttentionChoice("cudnn", "configured: cuDNN flash attention")
    if blocker:
        return AttentionChoice("xla", f"auto: {blocker}")
    return AttentionChoice("cudnn", f"auto: cuDNN flash attention, {compute_dtype}, "
                                    f"head_dim {head_dim}")


def attend(q: jax.Array, k: jax.Array, v: jax.Array, implementation: str) -> jax.Array:
    """Causal attention of ``q`` over ``k``, ``v`` (``[batch, seq, heads, head_dim]``; fewer kv
    heads for grouped-query attention) with ``implementation`` ("xla" | "cudnn"). cuDNN's runs
    on local arrays (see :data:`QUERY_NAMES`), so it also runs inside the pipeline's and the
    gradient reducer's shard_maps; XLA's is partitioned by XLA as before."""
    call = partial(jax.nn.dot_product_attention, is_causal=True, implementation=implementation)
    if implementation == "cudnn":
        return attend_locally(call, q, k, v)
    if recomputes_attention():  # model.remat = "selective"
        return _recomputed(call)(q, k, v)
    return call(q, k, v)


def _recomputed(call: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
    """``call`` whose backward pass recomputes it from its inputs: the forward keeps only
    ``q, k, v`` (an enclosing checkpoint's policy cannot make it keep the S x S arrays: they
    never leave this VJP), as flash attention does and Megatron's selective recomputation."""

    @jax.custom_vjp
    def core(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return call(q, k, v)

    def forward(q: jax.Array, k: jax.Array, v: jax.Array) -> tuple:
        return call(q, k, v), (q, k, v)

    def backward(inputs: tuple, grad: jax.Array) -> tuple:
        return jax.vjp(call, *inputs)[1](grad)

    core.defvjp(forward, backward)
    return core


def attend_locally(call: Callable[..., jax.Array], q: jax.Array, k: jax.Array, v: jax.Array
                   ) -> jax.Array:
    """``call(q, k, v)`` on local arrays (:func:`jaxmp.sharding.activations.local`). Where the
    kv heads do not split over the mesh as the query heads do (kv heads 4 on tensor 8, heads
    32), each kv head is first repeated for the query heads of its group, as Megatron
    replicates kv heads over a tensor group wider than their count: a device's query heads
    then meet the kv heads they read (the local call would pair local head i with kv head i)."""
    specs = local_specs([q.shape, k.shape], [QUERY_NAMES, KV_NAMES])
    if specs is not None and k.shape[2] != q.shape[2] and \
            tuple(specs[0])[2:3] != tuple(specs[1])[2:3]:
        group = q.shape[2] // k.shape[2]
        k, v = (jnp.repeat(a, group, axis=2) for a in (k, v))
    return local(call, (q, k, v), (QUERY_NAMES, KV_NAMES, KV_NAMES), QUERY_NAMES)
