"""What several studies share: the devices asked for, meshes named as `jaxmp bench` names them,
GPT configs, timing, and the page cache of files on disk."""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from jaxmp.cli.train import device_count, present_devices
from jaxmp.errors import UsageError

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def devices(args: argparse.Namespace, at_least: int = 1) -> list:
    """The devices a study runs on: ``--devices N`` of those present (default all)."""
    found = present_devices(device_count(args))
    if len(found) < at_least:
        raise UsageError(f"this study needs {at_least} devices, got {len(found)} (add "
                         f"--simulate-devices {at_least} to simulate them on the CPU)")
    return found


def label(axes: dict[str, int]) -> str:
    """``{"data": 2, "fsdp": 2, "tensor": 2}`` → ``data2×fsdp2×tensor2`` (the docs' tables)."""
    from jaxmp.config import MESH_AXES

    return "×".join(f"{a}{axes[a]}" for a in MESH_AXES if axes.get(a, 1) != 1) or "one device"


def meshes(text: str, n: int) -> list[tuple[str, dict[str, int]]]:
    """``--meshes`` in `jaxmp bench`'s strategy syntax (``dp,fsdp,data=2,fsdp=2,tensor=2``) on
    ``n`` devices: (label, {axis: size})."""
    from jaxmp.mesh import resolve_axes
    from jaxmp.tools.strategies import parse_strategies

    out = []
    for spec in parse_strategies(text):
        if spec.planned:
            raise UsageError(f"--meshes: {spec.name!r} is the planner's choice, not a mesh")
        try:
            axes = {a: s for a, s in resolve_axes(spec.mesh(n), n).items() if s != 1}
        except ValueError as e:
            raise UsageError(f"--meshes: {spec.name} on {n} devices: {e}") from None
        out.append((label(axes), axes))
    return out


def mesh_sets(axes: dict[str, int]) -> list[str]:
    """Config overrides fixing all four mesh axes (missing ones 1)."""
    from jaxmp.tools.strategies import full_mesh

    return [f"mesh.{a}={v}" for a, v in full_mesh(axes).items()]


def research_lm() -> Any:
    """examples/train_research_lm.py as a module: the research-style LM studies measure."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    return importlib.import_module("train_research_lm")


def gpt(sets: Sequence[str]) -> Any:
    """The GPT recipe's config: defaults (configs/tiny.toml), then ``sets``."""
    from jaxmp.recipes.gpt_config import load_config

    return load_config(None, list(sets))


def by_kind(stats: Any) -> str:
    """Collective bytes by kind, as the doc tables write them."""
    return ", ".join(f"{k} {v:,.0f}" for k, v in stats.bytes_by_kind.items() if v)


def times(fn: Callable, args: Sequence[Any], repeats: int, warm: bool = True) -> list[float]:
    """Seconds of ``repeats`` calls of ``fn(*args)``, each waited for (after one untimed call
    that compiles, unless ``warm`` is False)."""
    import jax

    if warm:
        jax.block_until_ready(fn(*args))
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        out.append(time.perf_counter() - start)
    return out


def _files(path: Path) -> list[Path]:
    return [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]


def fsync_all(path: Path) -> None:
    """Make every file under ``path`` durable (what a dd baseline's fsync guarantees)."""
    for f in _files(path):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def evict(path: Path) -> None:
    """Drop the page cache of every file under ``path`` (clean pages only; no root needed)."""
    for f in _files(path):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def add_cpu_or_gpu(p: argparse.ArgumentParser, default: str = "cpu") -> None:
    """The ``part`` argument of the byte studies: ``cpu`` (8 devices) or ``gpu`` (8 deviceless
    H100s)."""
    p.add_argument("part", nargs="?", default=default, choices=["cpu", "gpu"],
                   help="cpu: 8 devices; gpu: 8 deviceless H100s (default %(default)s)")


def eight_devices(args: argparse.Namespace) -> list:
    """8 devices to compile for: simulated CPUs, or (``part = gpu``) 8 deviceless H100s with
    the CUDA plugin kept off any driver and the persistent cache off."""
    if args.part != "gpu":
        return devices(args, at_least=8)[:8]
    from jaxmp._util.env import use_cpu

    use_cpu()  # the CUDA plugin compiles for absent GPUs; it must not look for a driver
    from jaxmp.topology import gpu_topology, without_persistent_cache

    without_persistent_cache()
    return list(gpu_topology(8, "H100").devices)
