"""The one place that edits the XLA environment: simulated CPU devices and extra XLA flags.

XLA reads ``XLA_FLAGS`` once, when jax's backend starts, so these must run before any jax
computation (importing jax is fine; ``jax.devices()`` is too late). Stdlib only.
"""

from __future__ import annotations

import ctypes
import os
import sys

_COUNT_FLAG = "--xla_force_host_platform_device_count"


def add_xla_flags(flags: str) -> None:
    """Append ``flags`` to ``XLA_FLAGS`` (a flag given again replaces the earlier value)."""
    new = flags.split()
    if not new:
        return
    names = {f.split("=", 1)[0] for f in new}
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if f.split("=", 1)[0] not in names]
    os.environ["XLA_FLAGS"] = " ".join(kept + new)


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
    still runs on them (``jaxmp bench --devices N`` means N GPUs there, N CPUs elsewhere).
    Raises ValueError for ``n < 1`` and RuntimeError when jax's backend already started.
    """
    if n < 1:
        raise ValueError(f"the simulated device count must be >= 1, got {n}")
    if backend_started():
        raise RuntimeError("simulated devices must be set before jax starts its backend")
    add_xla_flags(f"{_COUNT_FLAG}={n}")
    if not force_cpu:
        return
    os.environ["JAX_PLATFORMS"] = "cpu"
    jax = sys.modules.get("jax")
    if jax is not None:  # imported but not started: it read JAX_PLATFORMS already
        jax.config.update("jax_platforms", "cpu")


def simulate_devices_from_argv(argv: list[str], default: int = 8) -> None:
    """For example scripts: ``--devices N`` (default ``default``) simulated CPU devices, read
    from ``argv`` before jax starts; ``--devices 0`` keeps the real devices."""
    import argparse

    early = argparse.ArgumentParser(add_help=False)
    early.add_argument("--devices", type=int, default=default)
    n = early.parse_known_args(argv)[0].devices
    if n > 0:
        simulate_devices(n)


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
