"""Where a model reads a parameter slice: pin it to its own sharding, and let the trainer choose
how it is gathered.

A scanned layer stack reads one layer's weights per iteration; the model pins that slice to
the layer's sharding (:func:`constrain_param`), which makes the partitioner gather it (fsdp)
right there and reduce-scatter its gradient by transposition. Inside :func:`param_gathering`
the trainer's gather function also runs on the slice, so the weights can travel in a narrower
dtype than the float32 master copy (bf16 or int8, :mod:`jaxmp.compression.gather`). Outside it
this is exactly :func:`jaxmp.sharding.constrain`.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from jaxmp.sharding.activations import constrain

GatherFn = Callable[[Any, Sequence[str | None]], Any]  # (sharded slice, names) -> gathered
_GATHER: contextvars.ContextVar[GatherFn | None] = contextvars.ContextVar(
    "jaxmp_param_gathering", default=None)


@contextlib.contextmanager
def param_gathering(fn: GatherFn | None) -> Iterator[None]:
    """While tracing inside, :func:`constrain_param` hands each slice to ``fn``."""
    token = _GATHER.set(fn)
    try:
        yield
    finally:
        _GATHER.reset(token)


def constrain_param(x: Any, names: Sequence[str | None]) -> Any:
    """Constrain a parameter (slice) ``x`` to its own sharding by logical ``names``; under
    :func:`param_gathering`, return it gathered as the trainer chose."""
    x = constrain(x, names)
    fn = _GATHER.get()
    return x if fn is None else fn(x, names)
