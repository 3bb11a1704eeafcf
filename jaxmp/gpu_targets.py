"""GPU compile targets as data: what XLA's GPU compiler needs to know about a device it cannot see.

A deviceless compile (:mod:`jaxmp.topology`) hands the CUDA plugin a ``GpuTargetConfigProto``
in text form instead of querying a driver. Its numbers decide kernel tiling, fusion and
scheduling heuristics, which cuDNN kernels are legal (compute capability, cuDNN version) and the
memory limit the compiler plans against, so they must be those of the device the program will
run on. One target per GPU profile of :data:`jaxmp.devices.PROFILES` (same keys), so one
``--device-kind`` picks both the planner's numbers and the compile target.

Sources, cited per number below:

* [A100-WP] NVIDIA A100 Tensor Core GPU Architecture whitepaper (2020): 108 SMs, 64 FP32 cores
  per SM, 40 MB L2, 164 KB shared memory per SM (163 KB per block), 1410 MHz boost.
* [A100-DS] NVIDIA A100 datasheet: 1,555 GB/s (40 GB HBM2), 2,039 GB/s (80 GB HBM2e, SXM).
* [H100-WP] NVIDIA H100 Tensor Core GPU Architecture whitepaper (2022): H100 SXM5 132 SMs, 128
  FP32 cores per SM, 50 MB L2, 228 KB shared memory per SM (227 KB per block).
* [H100-DS] NVIDIA H100 datasheet: 80 GB HBM3, 3.35 TB/s (SXM).
* [H200-DS] NVIDIA H200 datasheet: 141 GB HBM3e, 4.8 TB/s; the H100's GH100 die (132 SMs).
* [CUDA-CC] CUDA C++ Programming Guide, "Technical Specifications per Compute Capability":
  1024 threads per block, 2048 per SM, 64 K 32-bit registers per SM and per block, 48 KB static
  shared memory per block, grid limits 2^31-1 x 65535 x 65535, block limits 1024 x 1024 x 64.
* [XLA-SPEC] what the driver reports (``cudaDeviceProp``: totalGlobalMem, clockRate), as
  recorded from real devices in XLA's own target files
  (openxla/xla ``xla/backends/gpu/target_config/specs/{a100_sxm_40,a100_sxm_80,h100_sxm,
  h200}.txtpb``). The memory size is the driver's figure, a little under the marketed one.

Software versions are not device facts: the cuDNN and CUDA runtime versions are those the
installed ``jax[cuda12]`` wheels bring (what a cluster installing the same extra runs), read
from the installed packages, with :data:`DEFAULT_CUDNN` / :data:`DEFAULT_CUDA` when absent.
Stdlib only.
"""

from __future__ import annotations

import importlib.metadata
import re
from dataclasses import dataclass

KiB = 1024
DEFAULT_CUDNN = (9, 8, 0)  # cuDNN of jax[cuda12] 0.10 (nvidia-cudnn-cu12 >= 9.8)
DEFAULT_CUDA = (12, 8, 0)


@dataclass(frozen=True)
class GpuTarget:
    """One GPU model as the compiler sees it (one ``gpu_device_info`` message)."""

    kind: str  # the device profile's key (jaxmp.devices.PROFILES)
    name: str  # what the driver calls it: becomes every device's ``device_kind``
    compute_capability: tuple[int, int]
    accelerated: bool  # sm_90a ("9.0a"): Hopper's wgmma / TMA instructions
    sm_count: int
    fp32_cores_per_sm: int
    clock_ghz: float
    memory_bytes: int  # device memory as the driver reports it
    memory_bandwidth: float  # bytes/s
    l2_cache_bytes: int
    shared_memory_per_sm: int
    shared_memory_per_block_optin: int
    # Limits every compute capability 8.x / 9.x shares [CUDA-CC].
    shared_memory_per_block: int = 48 * KiB
    threads_per_block: int = 1024
    threads_per_warp: int = 32
    threads_per_sm: int = 2048
    registers_per_sm: int = 64 * KiB
    registers_per_block: int = 64 * KiB
    block_dim_limit: tuple[int, int, int] = (2**31 - 1, 65535, 65535)
    thread_dim_limit: tuple[int, int, int] = (1024, 1024, 64)
    pcie_bandwidth: int = 32 * 1024**3  # PCIe 4.0/5.0 x16 as XLA records it [XLA-SPEC]


_A100 = dict(compute_capability=(8, 0), accelerated=False, sm_count=108,  # [A100-WP]
             fp32_cores_per_sm=64, clock_ghz=1.41, l2_cache_bytes=40 * KiB**2,  # [A100-WP]
             shared_memory_per_sm=164 * KiB, shared_memory_per_block_optin=163 * KiB)
_GH100 = dict(compute_capability=(9, 0), accelerated=True, sm_count=132,  # [H100-WP]
              fp32_cores_per_sm=128, clock_ghz=1.98,  # clockRate [XLA-SPEC]
              l2_cache_bytes=50 * KiB**2,  # [H100-WP]
              shared_memory_per_sm=228 * KiB, shared_memory_per_block_optin=227 * KiB)

TARGETS: dict[str, GpuTarget] = {
    "A100-40GB": GpuTarget("A100-40GB", "NVIDIA A100-SXM4-40GB", **_A100,
                           memory_bytes=42_331_013_120,  # [XLA-SPEC] a100_sxm_40
                           memory_bandwidth=1_555e9),  # [A100-DS]
    "A100-80GB": GpuTarget("A100-80GB", "NVIDIA A100-SXM4-80GB", **_A100,
                           memory_bytes=85_100_068_864,  # [XLA-SPEC] a100_sxm_80
                           memory_bandwidth=2_039e9),  # [A100-DS]
    "H100": GpuTarget("H100", "NVIDIA H100 80GB HBM3", **_GH100,
                      memory_bytes=84_942_979_072,  # [XLA-SPEC] h100_sxm
                      memory_bandwidth=3_350e9),  # [H100-DS]
    # The 96 GB H100 (Meta's Grand Teton hosts, where torchtitan measures; GH200's H100).
    # NVIDIA publishes no datasheet for it: memory is 96 GiB scaled by the 80 GB part's
    # reported / nominal ratio (0.98887), estimated, not recorded. Bandwidth: torchtitan's
    # docs/performance.md says its H100s have "96GB HBM2e with 2.4 TB/sec peak memory
    # bandwidth" (and run at a 500 W power limit).
    "H100-96GB": GpuTarget("H100-96GB", "NVIDIA H100 96GB HBM3", **_GH100,
                           memory_bytes=101_931_574_886, memory_bandwidth=2_400e9),
    "H200": GpuTarget("H200", "NVIDIA H200", **_GH100,
                      memory_bytes=151_397_597_184,  # [XLA-SPEC] h200
                      memory_bandwidth=4_800e9),  # [H200-DS]
}


def _installed_version(package: str, default: tuple[int, int, int]) -> tuple[int, int, int]:
    """``major.minor.patch`` of an installed distribution (the wheel's), else ``default``."""
    try:
        found = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", importlib.metadata.version(package))
    except importlib.metadata.PackageNotFoundError:
        return default
    if not found:
        return default
    return int(found[1]), int(found[2]), int(found[3] or 0)


def software_versions() -> dict[str, tuple[int, int, int]]:
    """The cuDNN and CUDA runtime a deviceless compile assumes (see the module docstring)."""
    cuda = _installed_version("nvidia-cuda-runtime-cu12", DEFAULT_CUDA)
    return {"cudnn": _installed_version("nvidia-cudnn-cu12", DEFAULT_CUDNN),
            "cuda": (cuda[0], cuda[1], 0)}


def target_config(target: GpuTarget, versions: dict[str, tuple[int, int, int]] | None = None
                  ) -> str:
    """``target`` as a ``stream_executor.GpuTargetConfigProto`` in text format.

    Only fields that both jax 0.10's and 0.12's CUDA plugins know are written (the parser
    rejects unknown ones). ``dnn_version_info`` is read by 0.10; 0.12 reads the string
    ``gpu_device_info.dnn_version``; both are given.
    """
    v = versions or software_versions()
    dnn, cuda = v["cudnn"], v["cuda"]
    major, minor = target.compute_capability
    suffix = "a" if target.accelerated else ""
    t = target
    fields = [
        ("threads_per_block_limit", t.threads_per_block), ("threads_per_warp", t.threads_per_warp),
        ("shared_memory_per_block", t.shared_memory_per_block),
        ("shared_memory_per_core", t.shared_memory_per_sm),
        ("threads_per_core_limit", t.threads_per_sm), ("core_count", t.sm_count),
        ("fpus_per_core", t.fp32_cores_per_sm),
        ("block_dim_limit_x", t.block_dim_limit[0]), ("block_dim_limit_y", t.block_dim_limit[1]),
        ("block_dim_limit_z", t.block_dim_limit[2]),
        ("memory_bandwidth", int(t.memory_bandwidth)), ("l2_cache_size", t.l2_cache_bytes),
        ("clock_rate_ghz", t.clock_ghz), ("device_memory_size", t.memory_bytes),
        ("shared_memory_per_block_optin", t.shared_memory_per_block_optin),
    ]
    lines = [f"  {k}: {val}" for k, val in fields]
    lines += ["  cuda_compute_capability {", f"    major: {major}", f"    minor: {minor}",
              f"    feature_extension: {'ACCELERATED_FEATURES' if t.accelerated else 'NONE'}",
              "  }"]
    strings = [("device_vendor", "NVIDIA Corporation"),
               ("platform_version", f"Compute Capability {major}.{minor}{suffix}"),
               ("name", t.name), ("driver_version", _dotted(cuda)),
               ("runtime_version", _dotted(cuda)),
               ("compile_time_toolkit_version", _dotted(cuda)), ("dnn_version", _dotted(dnn))]
    lines += [f"  registers_per_core_limit: {t.registers_per_sm}",
              f"  registers_per_block_limit: {t.registers_per_block}",
              f"  thread_dim_limit_x: {t.thread_dim_limit[0]}",
              f"  thread_dim_limit_y: {t.thread_dim_limit[1]}",
              f"  thread_dim_limit_z: {t.thread_dim_limit[2]}",
              f"  device_address_bits: 64", f"  pcie_bandwidth: {t.pcie_bandwidth}",
              "  ecc_enabled: true"]
    lines += [f'  {k}: "{val}"' for k, val in strings]
    return "\n".join(["gpu_device_info {", *lines, "}", 'platform_name: "CUDA"',
                      "dnn_version_info {", f"  major: {dnn[0]}", f"  minor: {dnn[1]}",
                      f"  patch: {dnn[2]}", "}", f'device_description_str: "{t.name}"', ""])


def _dotted(v: tuple[int, ...]) -> str:
    return ".".join(map(str, v))
