"""Pin the batch dim of research models' activations at their layer boundaries.

jaxmp's GPT names its activations (``sharding.constrain``); research code usually does not, and
GSPMD is then free to pick activation shardings that fight the parameters' — on
data2×fsdp2×tensor2 it falls back to "involuntary full rematerialization" and doubles the bytes
on the wire. The Trainer knows one thing for certain about every activation: which dim is the
batch. So inside the step it constrains the batch inputs and each top-level layer's array
inputs and outputs whose leading dim is the batch rows, by the logical name ``batch``, and
leaves every other dim ``UNCONSTRAINED`` (the partitioner still chooses, e.g. a vocab-split
head). Constraints never change values, only where they live.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxmp import sharding
from jaxmp.cost.trace import around_layers


def pin_batch(tree: Any, rows: int, mesh: Mesh, rules: Sequence) -> Any:
    """Constrain the leading dim of every array in ``tree`` with ``rows`` rows to the mesh axes
    of the logical name ``batch``; other dims unconstrained, other arrays untouched."""
    axes = sharding.logical_spec(("batch",), (rows,), mesh, rules)
    if not len(axes) or axes[0] is None:
        return tree  # the batch is not split on this mesh: nothing to pin

    def pin(x: Any) -> Any:
        if not isinstance(x, jax.Array) or x.ndim == 0 or x.shape[0] != rows:
            return x
        spec = P(axes[0], *([P.UNCONSTRAINED] * (x.ndim - 1)))
        return jax.lax.with_sharding_constraint(x, sharding.named(mesh, spec))

    # NNX objects passed along (an nnx.Rngs, a submodule) are pytrees too; rebuilding one from
    # its leaves would give the layer a copy (an Rngs whose draws no longer advance the
    # caller's counter), so they are passed through untouched.
    return jax.tree.map(pin, tree, is_leaf=lambda x: isinstance(x, (nnx.Pytree, nnx.Variable)))


@contextlib.contextmanager
def pinned_layers(model: Any, rows: int, mesh: Mesh, rules: Sequence) -> Iterator[None]:
    """While inside, ``model``'s top-level layers see and return batch-pinned activations."""

    def around(call: Any, args: tuple, kwargs: dict) -> Any:
        args, kwargs = pin_batch((args, kwargs), rows, mesh, rules)
        return pin_batch(call(*args, **kwargs), rows, mesh, rules)

    with around_layers(model, around):
        yield
