"""jaxmp: a sharded trainer for JAX/Flax.

Names are imported lazily so that ``import jaxmp.config`` (and the CLI) can settle XLA flags
before jax is imported.
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"
_EXPORTS = {
    "make_mesh": ("jaxmp.mesh", "make_mesh"),
    "load_config": ("jaxmp.config", "load_config"),
    "Config": ("jaxmp.config", "Config"),
    "ConfigError": ("jaxmp.config", "ConfigError"),
    "Trainer": ("jaxmp.train.loop", "Trainer"),
}
_SUBMODULES = {"rules", "checkpoint", "config", "data", "mesh", "models", "planner", "cost", "hlo"}
__all__ = sorted(_EXPORTS) + sorted(_SUBMODULES)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        module, attr = _EXPORTS[name]
        return getattr(importlib.import_module(module), attr)
    if name in _SUBMODULES:
        return importlib.import_module(f"jaxmp.{name}")
    raise AttributeError(f"module 'jaxmp' has no attribute {name!r}")
