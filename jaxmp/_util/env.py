"""The one place that edits the XLA environment: the platform, simulated CPU devices, extra
XLA flags and the GPU memory fraction.

XLA reads ``XLA_FLAGS`` (and JAX ``JAX_PLATFORMS``) once, when jax's backend starts, so these
must run before any jax computation (importing jax is fine; ``jax.devices()`` is too late).
Stdlib only.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
from collections.abc import Callable

_COUNT_FLAG = "--xla_force_host_platform_device_count"


def add_xla_flags(flags: str) -> None:
    """Append ``flags`` to ``XLA_FLAGS`` (a flag given again replaces the earlier value)."""
    new = flags.split()
    if not new:
        return
    names = {f.split("=", 1)[0] for f in new}
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if f.split("=", 1)[0] not in names]
    os.environ["XLA_FLAGS"] = " ".join(kept + new)


# XLA flags jaxmp gives every GPU compile (``jaxmp train`` on GPUs and the deviceless compile
# of ``jaxmp plan --aot`` / ``jaxmp bench --aot`` alike; the config's ``[xla].flags`` and the
# user's ``XLA_FLAGS`` come after them and win). They hide fsdp's weight gathers and gradient
# reductions behind compute: the latency-hiding scheduler; collectives of a layer loop
# pipelined into the previous iteration, the loop unrolled twice so that they can be; small
# collectives combined, all-gathers up to 1 GiB (a layer's gathered weights: one transfer per
# layer, started a layer ahead) and not split by dimension. Without the 1 GiB threshold and the
# combining across dims, 4 of the 16 all-gathers in the 8B GPT's layer loop on 8 H100s had no
# matmul to hide behind (docs/planner.md). MaxText's GPU configs set the same flags. Two
# collectives in flight, not XLA's default one: with tensor parallelism the tensor
# all-reduces held the one slot, so the next layer's pipelined fsdp gather could start only
# after the layer's last matmul (Llama-3-70B's shape, fsdp 16 x tensor 4, 4 layers: 2 of 4
# loop all-gathers exposed → 0; docs/planner.md §7 "Stop 28"). Three only where a plan asks
# (:data:`FSDP_ACCUMULATION_GPU_FLAGS`): globally they hold one more sequence-parallel
# gather's buffer the planner does not charge (§7 "Stop 29").
# Collective pipelining is spelt two ways: jaxlib 0.10's booleans and jaxlib 0.12's
# ``CollectivePipeliningMode`` enums (whose default, tied to the optimisation effort, left
# every layer-loop gather synchronous); each XLA drops the spelling it lacks, quietly.
_PIPELINED = ("all_gather", "reduce_scatter", "all_reduce")
_OLD_PIPELINING = tuple(f"xla_gpu_enable_pipelined_{k}" for k in _PIPELINED)
_NEW_PIPELINING = tuple(f"xla_gpu_pipeline_{k}" for k in _PIPELINED)
GPU_XLA_FLAGS = " ".join([
    "--xla_gpu_enable_latency_hiding_scheduler=true",
    *(f"--{f}=true" for f in _OLD_PIPELINING),
    *(f"--{f}=COLLECTIVE_PIPELINING_MODE_ON" for f in _NEW_PIPELINING),
    "--xla_gpu_enable_while_loop_double_buffering=true",
    "--xla_gpu_all_gather_combine_threshold_bytes=1073741824",
    "--xla_gpu_reduce_scatter_combine_threshold_bytes=134217728",
    "--xla_gpu_all_reduce_combine_threshold_bytes=134217728",
    "--xla_gpu_enable_all_gather_combine_by_dim=false",
    "--xla_gpu_enable_reduce_scatter_combine_by_dim=false",
    "--xla_gpu_experimental_parallel_collective_overlap_limit=2"])
# What a plan with fsdp > 1 and accumulating microbatches adds (``Layout.xla_flags``): three
# collectives in flight. There the backward layer loop ends with two gradient reduce-scatters
# (bf16 weights, float32 norm scales) that hold both slots, so the prefetch of the next
# layer's fsdp gather started after the last matmul: Llama-3-70B's shape, fsdp 16 x tensor 4,
# 2 microbatches, 4 layers: 4 of 8 layer-loop gathers exposed → 0 (§7 "Stop 29", "Stop 31").
FSDP_ACCUMULATION_GPU_FLAGS = "--xla_gpu_experimental_parallel_collective_overlap_limit=3"
# What a plan with fsdp > 1 and no pipeline stages adds (``Layout.xla_flags``): layer loops
# not double-buffered, one layer an iteration. Double-buffered, the body runs two layers and
# the scheduler issued the next iteration's weight gather after the body's last matmul: c9 on
# 16 A100s 3 of 4 layer-loop gathers exposed, c7 6 of 8, the 8-H100 test's fsdp 8 2 of 4; one
# layer an iteration, each gather starts at the top of the previous one: 0 exposed, peaks
# +0 ... +3 % (docs/planner.md §7 "Stop 34 (Xg)", "Stop 35 (Db)"). Both jaxlibs spell it so.
SINGLE_LAYER_BODY_GPU_FLAGS = "--xla_gpu_enable_while_loop_double_buffering=false"
# Flags of GPU_XLA_FLAGS that only some jaxlib versions know: dropped without a word.
VERSIONED_GPU_FLAGS = frozenset(_OLD_PIPELINING + _NEW_PIPELINING)
GPU_FLAG_PREFIX = "--xla_gpu_"


def gpu_compile_options(config_flags: str = "", plan_flags: str = ""
                        ) -> dict[str, bool | int | float | str]:
    """The GPU flags of one compile as ``compile(compiler_options=...)`` takes them:
    :data:`GPU_XLA_FLAGS`, then the plan's (``Layout.xla_flags``), then the config's
    ``[xla].flags``, then ``XLA_FLAGS`` (the last value of a flag wins; only ``--xla_gpu_*``
    flags, the others are not per-compile options).

    Per compile rather than through ``XLA_FLAGS`` because XLA's GPU compiler reads that once
    per process: a deviceless compile in a process that already compiled (tests, ``bench``)
    would keep the first flags it saw.
    """
    out: dict[str, bool | int | float | str] = {}
    for source in (GPU_XLA_FLAGS, plan_flags, config_flags, os.environ.get("XLA_FLAGS", "")):
        for flag in source.split():
            if not flag.startswith(GPU_FLAG_PREFIX):
                continue
            name, _, value = flag[2:].partition("=")
            if name in _NEW_PIPELINING and "_MODE_" not in value:  # XLA_FLAGS spells "on"
                value = f"COLLECTIVE_PIPELINING_MODE_{value.upper()}"
            out[name] = _flag_value(value)
    return out


def _flag_value(text: str) -> bool | int | float | str:
    """An XLA flag's value as the compile option's type (``true`` a bool, digits an int)."""
    if text.lower() in ("", "true", "false"):
        return text.lower() != "false"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def backend_started() -> bool:
    """True once jax has created its backends (then XLA flags no longer take effect)."""
    jax = sys.modules.get("jax")
    if jax is None:
        return False
    try:
        from jax._src import xla_bridge  # private, but the only way to ask without starting it
        return bool(getattr(xla_bridge, "_backends", None))
    except Exception:  # noqa: BLE001 - an unknown jax layout: assume it started
        return True


def simulate_devices(n: int, force_cpu: bool = True) -> None:
    """Run on ``n`` simulated CPU devices (testing a mesh without accelerators).

    ``force_cpu=False`` only gives the CPU backend ``n`` devices: a host with accelerators
    still runs on them.
    Raises ValueError for ``n < 1`` and RuntimeError when jax's backend already started.
    """
    if n < 1:
        raise ValueError(f"the simulated device count must be >= 1, got {n}")
    if backend_started():
        raise RuntimeError("simulated devices must be set before jax starts its backend")
    add_xla_flags(f"{_COUNT_FLAG}={n}")
    if force_cpu:
        use_cpu()


def use_cpu() -> None:
    """Run JAX on the CPU backend only (simulated devices, deviceless GPU compiles)."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    jax = sys.modules.get("jax")
    if jax is not None and not backend_started():  # imported: it read JAX_PLATFORMS already
        jax.config.update("jax_platforms", "cpu")


# The PJRT plugins `pip install jax[cuda12]` and `jax[cuda13]` bring (GPU hosts' images carry
# either: the lent H200 of docs/benchmarks.md runs jax 0.11.2 with the CUDA 13 one).
CUDA_PLUGINS = ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")


def cuda_plugin_installed() -> bool:
    """True when one of JAX's CUDA plugins is importable (found, not imported)."""
    for name in CUDA_PLUGINS:
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except (ImportError, ValueError):
            continue
    return False


def gpu_usable() -> tuple[bool, str]:
    """Whether the CUDA driver sees a GPU, asked the way JAX's plugin asks, without JAX.

    Loads the driver library and calls ``cuInit(0)`` and ``cuDeviceGetCount``. Device nodes or
    ``nvidia-smi`` on the PATH would be cheaper guesses, but a container can have the nodes
    without a working driver (or the reverse), and ``CUDA_VISIBLE_DEVICES=""`` hides every
    GPU; the driver itself answers all of these. A host without the driver answers in
    microseconds (no library); on a GPU host JAX calls ``cuInit`` next anyway, and the
    driver does its work once per process. Returns ``(usable, reason)``.
    """
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False, "no CUDA driver (libcuda.so.1 not found)"
    try:
        rc = lib.cuInit(0)
        if rc:
            return False, f"cuInit failed with CUDA error {rc}"
        count = ctypes.c_int(0)
        rc = lib.cuDeviceGetCount(ctypes.byref(count))
    except (AttributeError, OSError) as e:  # a library by that name that is not the driver
        return False, f"libcuda.so.1 is not a usable CUDA driver ({e})"
    if rc or count.value < 1:
        return False, "the CUDA driver sees no GPU"
    return True, f"{count.value} GPU(s)"


def settle_platform() -> str | None:
    """Choose JAX's platform before it starts; returns an info line for the user, or None.

    A ``JAX_PLATFORMS`` the user set is kept. Otherwise, with JAX's CUDA plugin installed but
    no usable GPU (a login node, CI, a laptop) JAX runs on the CPU: left alone, the plugin
    would print a ``cuInit`` traceback at start-up and then fall back to the CPU anyway. With
    a usable GPU, or without the plugin, JAX chooses as usual (CUDA first when present).
    """
    global _PLATFORM_NOTE
    if backend_started():
        return None
    cpu, note = platform_decision(os.environ.get("JAX_PLATFORMS", ""), cuda_plugin_installed,
                                  gpu_usable)
    if cpu:
        use_cpu()
    _PLATFORM_NOTE = note
    return note


_PLATFORM_NOTE: str | None = None


def platform_note() -> str | None:
    """Why :func:`settle_platform` chose the CPU in this process (None: it did not), for a
    run's start-up line. Printed there rather than at once, so that bad input found before
    the run starts stays one line."""
    return _PLATFORM_NOTE


def platform_decision(user_choice: str, plugin_installed: Callable[[], bool],
                      probe: Callable[[], tuple[bool, str]]) -> tuple[bool, str | None]:
    """``(run on the CPU?, info line)`` for :func:`settle_platform`; the checks are passed in
    (and only made when needed) so the rule can be tested on any machine."""
    if user_choice.strip() or not plugin_installed():
        return False, None
    usable, why = probe()
    if usable:
        return False, None
    return True, f"jaxmp: running on the CPU: JAX's CUDA plugin is installed but {why}"


def may_use_gpu() -> bool:
    """False when JAX is limited to the CPU (``JAX_PLATFORMS=cpu``)."""
    return os.environ.get("JAX_PLATFORMS", "").strip().lower() != "cpu"


MEM_FRACTION = "XLA_PYTHON_CLIENT_MEM_FRACTION"


def set_gpu_memory_fraction(fraction: float) -> bool:
    """Let JAX's GPU allocator take ``fraction`` of each GPU's memory (what the planner may
    fill, ``device.usable_fraction``), unless the user set ``XLA_PYTHON_CLIENT_MEM_FRACTION``.
    Returns whether it was set."""
    if os.environ.get(MEM_FRACTION) or not 0 < fraction <= 1:
        return False
    os.environ[MEM_FRACTION] = f"{fraction:g}"
    return True


def simulate_devices_from_argv(argv: list[str]) -> None:
    """For example scripts: ``--simulate-devices N`` read from ``argv`` before jax starts (the
    flag ``jaxmp train`` takes); without it the devices present are used, the platform
    settled as ``jaxmp`` settles it (no CUDA-plugin traceback where no GPU is usable)."""
    import argparse

    early = argparse.ArgumentParser(add_help=False)
    early.add_argument("--simulate-devices", type=int, default=None)
    n = early.parse_known_args(argv)[0].simulate_devices
    if n is not None:
        simulate_devices(n)
    else:
        settle_platform()  # the Trainer's start-up line gives its note


_M_ARENA_MAX = -8  # glibc's mallopt parameter number (malloc.h)


def limit_malloc_arenas(n: int = 2) -> bool:
    """Cap glibc's malloc arenas before JAX starts its threads (``mallopt(M_ARENA_MAX, n)``).

    glibc gives threads that allocate at the same time their own arenas (up to 8 per core)
    and seldom hands their free memory back, so a long run's host RSS creeps up: on the tiny
    config, 25 MiB per 1000 steps by default, 2 MiB with 2 arenas (docs/reliability.md). Does
    nothing when ``MALLOC_ARENA_MAX`` is set (the user's choice) or off glibc. Returns whether
    the cap was set."""
    return _mallopt(_M_ARENA_MAX, n, "MALLOC_ARENA_MAX")


_M_MMAP_THRESHOLD = -3


def return_large_frees(threshold: int = 2**20) -> bool:
    """Serve every allocation of ``threshold`` bytes or more with its own mapping, so freeing
    it gives the memory back to the system (``mallopt(M_MMAP_THRESHOLD, threshold)``).

    glibc otherwise raises that threshold after each large free (up to 32 MiB) and keeps later
    blocks of that size in its heap, which a tool streaming tensors one at a time then never
    returns: the Hugging Face import of a 1 GB model peaked 70 MiB higher without this
    (docs/huggingface.md). Does nothing when ``MALLOC_MMAP_THRESHOLD_`` is set or off glibc."""
    return _mallopt(_M_MMAP_THRESHOLD, threshold, "MALLOC_MMAP_THRESHOLD_")


def _mallopt(param: int, value: int, env: str) -> bool:
    """glibc's ``mallopt(param, value)``, unless the user set ``env`` (their choice wins) or
    this is not glibc on Linux. Returns whether it was set."""
    if os.environ.get(env) or not sys.platform.startswith("linux"):
        return False
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(param, value))
    except (OSError, AttributeError):  # not glibc (e.g. musl)
        return False
