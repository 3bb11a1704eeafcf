"""jaxmp: a sharded trainer for JAX/Flax.

Names are imported lazily so that ``import jaxmp.config`` (and the CLI) can settle XLA flags
before jax is imported. The layers, bottom to top, are described in docs/architecture.md.
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"
_EXPORTS = {
    "make_mesh": ("jaxmp.mesh", "make_mesh"),
    "load_config": ("jaxmp.recipes.gpt_config", "load_config"),
    "Config": ("jaxmp.recipes.gpt_config", "Config"),
    "TrainerConfig": ("jaxmp.config", "TrainerConfig"),
    "ConfigError": ("jaxmp.errors", "ConfigError"),
    "Trainer": ("jaxmp.train", "Trainer"),
}
_SUBMODULES = {"checkpoint", "config", "cost", "data", "errors", "hlo", "mesh", "models", "plan",
               "rules", "sharding"}
__all__ = sorted(_EXPORTS) + sorted(_SUBMODULES)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        module, attr = _EXPORTS[name]
        return getattr(importlib.import_module(module), attr)
    if name in _SUBMODULES:
        return importlib.import_module(f"jaxmp.{name}")
    raise AttributeError(f"module 'jaxmp' has no attribute {name!r}")
