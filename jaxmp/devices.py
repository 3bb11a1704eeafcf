"""Device profiles: peak FLOP/s, memory and link bandwidths per device kind.

Used for MFU and by the planner's time predictions. Numbers are vendor peaks (dense bf16, no
sparsity); CPUs have no meaningful datasheet number, so their peak is measured with a matmul.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from functools import lru_cache


@dataclass(frozen=True)
class DeviceProfile:
    kind: str
    peak_flops: float  # dense bf16 FLOP/s per device
    memory_bytes: float  # HBM (or host RAM share) per device
    memory_bw: float  # bytes/s, HBM
    intra_host_bw: float  # bytes/s per device over the fastest link inside a host (NVLink)
    inter_host_bw: float  # bytes/s per device across hosts (InfiniBand / Ethernet)


GiB = 1024**3
PROFILES: dict[str, DeviceProfile] = {
    "A100-40GB": DeviceProfile("A100-40GB", 312e12, 40 * GiB, 1.555e12, 300e9, 25e9),
    "A100-80GB": DeviceProfile("A100-80GB", 312e12, 80 * GiB, 2.039e12, 300e9, 25e9),
    "H100": DeviceProfile("H100", 989e12, 80 * GiB, 3.35e12, 450e9, 50e9),
    "H200": DeviceProfile("H200", 989e12, 141 * GiB, 4.8e12, 450e9, 50e9),
    # CPU: peak measured at run time; memory is a share of a 24 GiB host; "links" are memcpy.
    "CPU": DeviceProfile("CPU", 5e10, 3 * GiB, 2e10, 1e10, 1e9),
}


def _match(device_kind: str) -> str:
    k = device_kind.upper()
    if "H200" in k:
        return "H200"
    if "H100" in k or "H800" in k:
        return "H100"
    if "A100" in k:
        return "A100-80GB" if "80" in k else "A100-40GB"
    return "CPU"


def profile_for(device_kind: str | None = None, measure_cpu: bool = True) -> DeviceProfile:
    """The profile for a ``jax.devices()[0].device_kind`` string (or a profile name)."""
    if device_kind is None:
        import jax

        device_kind = jax.devices()[0].device_kind
    name = device_kind if device_kind in PROFILES else _match(device_kind)
    prof = PROFILES[name]
    if name == "CPU" and measure_cpu:
        prof = replace(prof, peak_flops=measured_matmul_flops())
    return prof


@lru_cache(maxsize=1)
def measured_matmul_flops(n: int = 1024, repeats: int = 5) -> float:
    """FLOP/s of a large float32 matmul on the first device: the CPU's practical peak.

    Note: with simulated devices all of them share the same cores, so per-device MFU on CPU is
    measured against the whole host's matmul rate divided by nothing: it is an upper bound.
    """
    import jax
    import jax.numpy as jnp

    x = jnp.ones((n, n), jnp.float32)
    f = jax.jit(lambda a: a @ a)
    f(x).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        f(x).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best
