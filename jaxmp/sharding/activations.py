"""Activation sharding by logical name: model code calls :func:`constrain`; the trainer decides
whether it means anything by entering :func:`activation_sharding` around tracing."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jaxmp.sharding.resolve import DEFAULT_RULES, Rule, logical_spec, normalize_rules

_ACTIVE: contextvars.ContextVar[tuple[Any, tuple[Rule, ...]] | None] = contextvars.ContextVar(
    "jaxmp_activation_sharding", default=None)


@contextlib.contextmanager
def activation_sharding(mesh: Mesh, rules: Sequence[Rule] = DEFAULT_RULES) -> Iterator[None]:
    """Make :func:`constrain` apply sharding constraints on ``mesh`` while tracing inside.

    The context is read at trace time and is not part of jit's cache key: enter it around the
    first call (trace) of a jitted function, not around a later cached call.
    """
    token = _ACTIVE.set((mesh, normalize_rules(rules)))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def constrain(x: Any, names: Sequence[str | None]) -> Any:
    """Constrain activation ``x`` by logical names; identity outside :func:`activation_sharding`.

    Keeps model code runnable on one device and in tests without any mesh.
    """
    active = _ACTIVE.get()
    if active is None:
        return x
    mesh, rules = active
    spec = logical_spec(names, np.shape(x), mesh, rules)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
