"""Device profiles: peak FLOP/s, achievable efficiency, memory and link bandwidths per kind.

Used for MFU and by the planner's predictions. Peaks are vendor numbers per device (dense bf16,
no sparsity; NVLink and InfiniBand per direction); a cluster that differs (PCIe cards, fewer
NICs) overrides any of them from the config's ``[device]`` section. CPUs have no meaningful
datasheet number, so their peak is measured with a large matmul, and their memory is the host's
RAM, which all simulated devices of the host share.

No training step runs at the datasheet peak. ``efficiency`` is the fraction of ``peak_flops``
a transformer's training compute reaches in practice (matmuls with the memory-bound operations
between them, before communication and pipeline bubbles), from public measurements for GPUs
and measured here for the CPU (``python scripts/measure.py device-efficiency``);
docs/planner.md lists the sources. ``overlap``: the backend runs collectives asynchronously
beside compute (XLA's latency-hiding scheduler on GPUs); the CPU backend does not.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

import jax
import jax.numpy as jnp

from jaxmp.config import DeviceConfig
from jaxmp.errors import UnknownDeviceError
from jaxmp.gpu_targets import TARGETS

GiB = 1024**3


@dataclass(frozen=True)
class DeviceProfile:
    kind: str
    peak_flops: float  # dense bf16 FLOP/s per device
    memory_bytes: float  # HBM per device as the driver reports it (CPU: the host's RAM, shared)
    intra_host_bw: float  # bytes/s each device sends over the fastest link inside a host
    inter_host_bw: float  # bytes/s each device sends across hosts (InfiniBand / Ethernet)
    devices_per_host: int = 8  # 0: every device is on one host (simulated CPU devices)
    usable_fraction: float = 0.75  # of memory_bytes a process may fill (JAX GPU preallocation)
    efficiency: float = 0.5  # achievable fraction of peak_flops in a training step's compute
    overlap: bool = True  # collectives run beside compute (GPU latency-hiding scheduler)
    shared_host: bool = False  # devices share the host's cores and RAM (CPU simulation)
    # The backend computes 16-bit matmuls in float32 (XLA:CPU): their activations and the
    # collectives on them are float32-sized.
    upcasts_16bit: bool = False
    # The compiler sums the partial input gradients of the tensor-split matrices that read one
    # input before all-reducing them (XLA's all-reduce reassociation on GPUs): one backward
    # all-reduce per row-parallel matrix instead of one per matrix (XLA:CPU).
    reassociates_all_reduce: bool = True
    # The optimizer's update runs as fused elementwise kernels writing into the donated state
    # (XLA's GPU compiler: after the backward only the gradients and their reduced copy are
    # live, docs/benchmarks.md "Float32 master weights", stop 29); XLA:CPU computes the new
    # params and moments beside the old ones, the full-size gradients still live.
    updates_in_place: bool = True
    # Memory (HBM) bandwidth, bytes/s (jaxmp.gpu_targets' datasheet figure): the time model
    # charges the bytes that only memory moves — saved activations written in the forward and
    # read in the backward, per-microbatch accumulation and casts, the optimizer's update
    # (docs/planner.md §2, "Memory traffic"). 0: not charged (the CPU's time is all in
    # ``efficiency``, measured end to end).
    memory_bw: float = 0.0
    # XLA attention's backward holds its score-sized values (scores, probabilities and their
    # gradients) live together: the GPU's softmax-backward fusion reads the raw scores
    # (jaxmp.cost.liveness.Timeline.held_together). XLA:CPU frees them as the jaxpr does.
    holds_scores: bool = True
    # The large-GEMM plateau, a fraction of peak_flops, that weight matmuls approach as they
    # widen (jaxmp.plan.gemm); ``efficiency`` then times only the other FLOPs. 0: every FLOP at
    # ``efficiency`` (the CPU; a config's ``[device] efficiency`` sets it to 0: the flat
    # number it gives then times all compute).
    matmul_ceiling: float = 0.0
    # The loss gradient, written over the logits, stays live through the stack's backward:
    # XLA's GPU scheduler takes the head's weight gradient after the last block's backward
    # (jaxmp.plan.head). XLA:CPU is not measured for it and keeps the old model.
    holds_head_gradient: bool = True
    # A scanned layer stack stores only the residuals that survive fusion (LayerCost.fused:
    # with XLA attention two score arrays a layer, not JAX's three and the mask), and its
    # forward body holds the layer's own copies of them beside the stacks, with the
    # loop-invariant mask and fill hoisted before the loop (jaxmp.plan.forward;
    # docs/planner.md §7 "Stop 35 (Sc3)"). XLA:CPU stores JAX's residual list.
    scan_keeps_fused: bool = True

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# Efficiencies (docs/planner.md has the sources): A100 0.60 — Megatron-LM's 1T run reached 52 %
# of peak end to end, bubble and communication included, torchtitan's Llama 3 8B on A100s
# 57-58 % MFU; H100 0.45 — Megatron-Core GPT-3 175B ~390 TFLOP/s (39 %), Llama 3 405B 38-43 %
# MFU, torchtitan Llama 3.1 8B 33-39 %; H200: the H100's compute with 1.4x its memory bandwidth
# for the memory-bound operations, 0.50 (fewer public bf16 numbers). These time the non-matmul
# FLOPs and activation x activation matmuls; weight matmuls approach ``matmul_ceiling`` as they
# widen (jaxmp.plan.gemm), fitted with its knee on the published bf16 runs (recipes/published.py,
# docs/planner.md §7 "Stop 32 (Me2)"): 0.78 on the H100 chip (cuBLAS's large bf16 GEMMs reach
# 700-800 of its 989 TFLOP/s), 0.66 on the A100.
# Memory: what the driver reports (``cudaDeviceProp.totalGlobalMem``), the number JAX's GPU
# allocator takes its fraction of and the compile target's (jaxmp.gpu_targets): one number, so
# the planner, the allocator and a deviceless compile judge against the same limit.
def _bw(kind: str) -> float:
    return float(TARGETS[kind].memory_bandwidth)


PROFILES: dict[str, DeviceProfile] = {
    "A100-40GB": DeviceProfile("A100-40GB", 312e12, TARGETS["A100-40GB"].memory_bytes, 300e9,
                               25e9, efficiency=0.60, memory_bw=_bw("A100-40GB"),
                               matmul_ceiling=0.66),
    "A100-80GB": DeviceProfile("A100-80GB", 312e12, TARGETS["A100-80GB"].memory_bytes, 300e9,
                               25e9, efficiency=0.60, memory_bw=_bw("A100-80GB"),
                               matmul_ceiling=0.66),
    "H100": DeviceProfile("H100", 989e12, TARGETS["H100"].memory_bytes, 450e9, 50e9,
                          efficiency=0.45, memory_bw=_bw("H100"), matmul_ceiling=0.78),
    # The 96 GB HBM2e H100 (e.g. Meta's Grand Teton hosts, where torchtitan measures).
    "H100-96GB": DeviceProfile("H100-96GB", 989e12, TARGETS["H100-96GB"].memory_bytes, 450e9,
                               50e9, efficiency=0.45, memory_bw=_bw("H100-96GB"),
                               matmul_ceiling=0.78),
    "H200": DeviceProfile("H200", 989e12, TARGETS["H200"].memory_bytes, 450e9, 50e9,
                          efficiency=0.50, memory_bw=_bw("H200"), matmul_ceiling=0.78),
    # CPU: peak measured at run time (a 1024^2 float32 matmul), memory read from the host;
    # "links" are memcpy. A GPT's forward + backward reaches about half the matmul rate
    # (scripts/measure.py device-efficiency on 2 cores: 0.009 of 0.018 TFLOP/s).
    "CPU": DeviceProfile("CPU", 5e10, 16 * GiB, 1e10, 1e9, devices_per_host=0,
                         usable_fraction=0.8, efficiency=0.5, overlap=False, shared_host=True,
                         upcasts_16bit=True, reassociates_all_reduce=False,
                         updates_in_place=False,
                         holds_scores=False, holds_head_gradient=False,
                         scan_keeps_fused=False),
}
OVERRIDABLE = tuple(f.name for f in dataclasses.fields(DeviceProfile)
                    if f.name not in ("kind", "shared_host", "upcasts_16bit", "overlap",
                                      "updates_in_place", "holds_scores", "matmul_ceiling",
                                      "holds_head_gradient", "scan_keeps_fused"))


def match_kind(device_kind: str) -> str | None:
    """The profile name for a ``jax.devices()[0].device_kind`` string, or None."""
    if device_kind in PROFILES:
        return device_kind
    k = device_kind.upper()
    if "H200" in k:
        return "H200"
    if "H100" in k and "96" in k:
        return "H100-96GB"
    if "H100" in k or "H800" in k or "GH200" in k:
        return "H100"
    if "A100" in k or "A800" in k:
        return "A100-80GB" if "80" in k else "A100-40GB"
    if k in ("CPU", "HOST") or k.startswith("CPU"):
        return "CPU"
    return None


def _host_memory() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return PROFILES["CPU"].memory_bytes


def profile_for(device_kind: str | None = None, measure_cpu: bool = True,
                overrides: Mapping[str, Any] | None = None, strict: bool = False) -> DeviceProfile:
    """The profile for a ``device_kind`` string or profile name (default: the first device's).

    ``overrides`` (e.g. the config's ``[device]`` section) replaces any field; a value of 0 or
    None keeps the table's number. An unknown kind is an error with ``strict`` (the planner)
    unless overrides give at least ``peak_flops`` and ``memory_bytes``; otherwise (MFU) it gets
    the first device's measured matmul rate.
    """
    if device_kind is None:
        device_kind = jax.devices()[0].device_kind
    given = {k: v for k, v in (overrides or {}).items() if v not in (None, 0, 0.0, "")}
    bad = sorted(set(given) - set(OVERRIDABLE))
    if bad:
        raise UnknownDeviceError(f"device.{bad[0]}: not a device profile field "
                                 f"(fields: {', '.join(OVERRIDABLE)})")
    name = match_kind(device_kind)
    if name is None and not strict and not {"peak_flops", "memory_bytes"} <= set(given):
        name = "CPU"
    if name is None:
        if not {"peak_flops", "memory_bytes"} <= set(given):
            known = ", ".join(PROFILES)
            raise UnknownDeviceError(
                f"unknown device kind {device_kind!r} (known: {known}); give --device-kind or "
                f"set device.peak_flops and device.memory_bytes")
        base = replace(PROFILES["H100"], kind=device_kind)
    else:
        base = PROFILES[name]
        if name == "CPU":
            base = replace(base, memory_bytes=_host_memory())
            if measure_cpu and "peak_flops" not in given:
                base = replace(base, peak_flops=measured_matmul_flops())
    if "efficiency" in given:
        base = replace(base, matmul_ceiling=0.0)
    return replace(base, **given)


@lru_cache(maxsize=1)
def measured_matmul_flops(n: int = 1024, repeats: int = 5) -> float:
    """FLOP/s of a large float32 matmul on the first device: the CPU's practical peak.

    Note: with simulated devices all of them share the same cores, so this is the host's rate;
    the planner divides it among the host's devices (``shared_host``).
    """
    x = jnp.ones((n, n), jnp.float32)
    f = jax.jit(lambda a: a @ a)
    f(x).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        f(x).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def detected_kind(device: Any | None = None) -> str:
    """``device`` (default: this process's first) as a profile key ("CPU" for any CPU)."""
    dev = device if device is not None else jax.devices()[0]
    return "CPU" if dev.platform == "cpu" else dev.device_kind


def devices_kind(section: DeviceConfig, devices: Sequence[Any]) -> str | None:
    """The kind a run on ``devices`` is planned for: theirs when a profile knows it
    (deviceless GPUs are planned as those GPUs, not as this process's CPU), unless
    ``device.kind`` names one; None leaves it to :func:`profile_from_config` (which also
    describes an unknown device from its own memory stats)."""
    if not devices or section.kind not in ("", "auto"):
        return None
    kind = detected_kind(devices[0])
    return kind if match_kind(kind) is not None else None


def profile_from_config(section: DeviceConfig | None = None, device_kind: str | None = None,
                        strict: bool = True, measure_cpu: bool = True) -> DeviceProfile:
    """The profile for a run: ``device_kind``, else ``device.kind``, else the detected device,
    with the ``[device]`` section's non-zero fields as overrides.

    An unknown kind is an error when ``strict``; otherwise the first device describes itself:
    its memory limit from ``memory_stats()``, its peak measured (or nominal without
    ``measure_cpu``, which every process of a multi-host run must use so that all of them
    reach the same plan).
    """
    overrides = dataclasses.asdict(section) if section is not None else {}
    kind = device_kind or overrides.pop("kind", None)
    overrides.pop("kind", None)
    if kind in (None, "", "auto"):
        kind = detected_kind()
        if match_kind(kind) is None and not strict:
            limit = (jax.devices()[0].memory_stats() or {}).get("bytes_limit", 16 * GiB)
            overrides = {"peak_flops": measured_matmul_flops() if measure_cpu else 1e14,
                         "memory_bytes": float(limit), "usable_fraction": 1.0,
                         **{k: v for k, v in overrides.items() if v}}
    return profile_for(kind, overrides=overrides, strict=strict, measure_cpu=measure_cpu)
