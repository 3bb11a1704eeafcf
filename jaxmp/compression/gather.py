"""fsdp weight gathers in the compute dtype (or int8), not in the float32 master dtype.

ZeRO-3 gathers every weight before it is used. Gathering the float32 master copy and casting
afterwards moves twice the bytes a bfloat16 model needs; like FSDP2's mixed-precision policy and
ZeRO++'s quantized weights, a :class:`WeightGather` casts (or quantizes) each fsdp-split weight
*on its shard*, so what is gathered is the narrow copy:

* ``bfloat16``: :meth:`WeightGather.prepare` casts the shards; XLA gathers them where the model
  uses them (per layer inside a scanned stack) and reduce-scatters the bf16 gradients by
  transposition. Any model benefits. (XLA's CPU backend widens bf16 collectives to float32
  after partitioning; :func:`jaxmp.hlo.partitioned_text` shows the program before that.)
* ``int8``: one float32 scale per index of the fsdp-split dim (absmax over the other dims);
  int8 values and scales are gathered and dequantized into the compute dtype (lossy; the
  gradient passes straight through). Weights outside a layer stack are gathered by the step,
  each layer's slice by the model's :func:`jaxmp.sharding.constrain_param` (the GPT's scan);
  the backward pass reuses the forward's gathered weights instead of gathering again — half
  the gathers, but a device holds a whole dequantized stack during the step.

Gradients come back in the dtype the weights went out in: the reduce-scatter of an fsdp-split
weight's gradient is the weight-gradient matmul's own partial-sum reduction, which the SPMD
partitioner places at that matmul, in its output dtype — the compute dtype the gathered weight
was handed over in. So bfloat16 gathers reduce bfloat16 (half of float32's bytes, as FSDP2 with
``reduce_dtype=bfloat16``), int8's straight-through gradient reduces in the compute dtype and
float32 reductions (torchtitan's default) come with float32 gathers: ``compression.weights =
"param"``. Casting the gradient to float32 after the matmul does not widen the reduction
(checked in the GPU-compiled program: the reduce-scatters stay bfloat16); that would take
weight-gradient matmuls with float32 outputs. :func:`reduce_dtype` says which it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxmp import sharding
from jaxmp.config import WEIGHT_GATHERS

FSDP = "fsdp"
STACK_NAMES = ("layers", "stage")  # leading dims of a layer stack: sliced, not gathered whole
KINDS = WEIGHT_GATHERS
# Bytes per element on the wire of each gather / reduce dtype ("param": the stored dtype's).
WIRE_ITEMSIZE = {"bfloat16": 2, "float32": 4, "int8": 1}


def _axes(entry: Any) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def is_matrix(names: Sequence[str | None]) -> bool:
    """Whether a parameter with these logical names is a weight matrix (two or more dims
    besides a layer stack's): what a narrower gather casts; vectors move as stored."""
    return sum(n not in STACK_NAMES for n in names) >= 2


@dataclass(frozen=True)
class WeightGather:
    """Gather fsdp-split weights as ``wire`` ("bfloat16" | "int8"), handing the model
    ``out_dtype`` values."""

    wire: str
    out_dtype: str
    mesh: Mesh
    rules: tuple

    @property
    def reduce(self) -> str:
        """What the gradients' reduce-scatters move (:func:`reduce_dtype`)."""
        return reduce_dtype(self.wire, self.out_dtype)

    def _spec(self, names: Sequence[str | None], shape: Sequence[int]) -> tuple:
        spec = sharding.logical_spec(names, shape, self.mesh, self.rules)
        return tuple(spec) + (None,) * (len(shape) - len(spec))

    def __call__(self, x: jax.Array, names: Sequence[str | None]) -> jax.Array:
        """``x`` (one weight, or one layer's slice) gathered over fsdp as int8; other policies
        leave the gather to XLA (``prepare`` already cast the shard)."""
        names = sharding.fit_names(names, x.shape)
        spec = self._spec(names, x.shape)
        split = [d for d, e in enumerate(spec) if FSDP in _axes(e)]
        if self.wire != "int8" or not split or not is_matrix(names):
            return x
        sharded = sharding.named(self.mesh, P(*spec))
        gathered = sharding.named(self.mesh, sharding.spec_without(spec, FSDP))
        return _int8_gather(x, sharded, gathered, split, jnp.dtype(self.out_dtype))

    def prepare(self, params: Any) -> Any:
        """The step's view of the params: fsdp-split weight shards cast to bfloat16, or (int8)
        those outside a layer stack gathered now — stacked ones are gathered per layer by the
        model's :func:`constrain_param`."""

        def one(v: Any) -> Any:
            names, _ = sharding.names_of(v) if isinstance(v, nnx.Variable) else (None, "")
            x = v[...] if isinstance(v, nnx.Variable) else v
            if names is None or not jnp.issubdtype(x.dtype, jnp.floating):
                return v
            names = sharding.fit_names(names, x.shape)
            if self.wire == "int8":
                return v if names[0] in STACK_NAMES else v.replace(self(x, names))
            spec = self._spec(names, x.shape)
            if not is_matrix(names) or not any(FSDP in _axes(e) for e in spec):
                return v
            cast = x.astype(jnp.bfloat16)
            return v.replace(jax.lax.with_sharding_constraint(
                cast, sharding.named(self.mesh, P(*spec))))

        return jax.tree.map(one, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _int8_gather(x: jax.Array, sharded: NamedSharding, gathered: NamedSharding,
                 split: list[int], out_dtype: Any) -> jax.Array:
    master = x.dtype
    constrain = jax.lax.with_sharding_constraint

    def forward(x: jax.Array) -> jax.Array:
        other = tuple(d for d in range(x.ndim) if d not in split)
        xf = x.astype(jnp.float32)
        amax = jnp.max(jnp.abs(xf), axis=other, keepdims=True)
        scale = jnp.where(amax > 0, amax / 127.0, 1.0)
        q = constrain(jnp.clip(jnp.round(xf / scale), -127, 127).astype(jnp.int8), sharded)
        q = constrain(q, gathered)  # the int8 values are what moves
        scale = constrain(scale, NamedSharding(sharded.mesh, P()))
        return (q.astype(jnp.float32) * scale).astype(out_dtype)

    @jax.custom_vjp
    def gather(x: jax.Array) -> jax.Array:
        return forward(x)

    def fwd(x: jax.Array) -> tuple[jax.Array, None]:
        return forward(x), None

    def bwd(_: None, ct: jax.Array) -> tuple[jax.Array]:  # straight through
        return (constrain(ct, sharded).astype(master),)

    gather.defvjp(fwd, bwd)
    return gather(x)


def gather_dtype(kind: str, compute_dtype: str | None, fsdp: int) -> str:
    """What fsdp weight gathers move for ``compression.weights = kind``: ``"param"`` (as
    stored: no fsdp axis, ``param``, or ``auto`` with no narrower compute dtype known —
    ``compute_dtype`` is the model's, e.g. ``model.compute_dtype``), ``"bfloat16"`` or
    ``"int8"``. The planner decides it once; the Trainer builds :func:`weight_gather` from it."""
    if kind not in KINDS:
        raise ValueError(f"unknown gather dtype {kind!r}")
    if fsdp == 1:
        return "param"
    if kind == "auto":
        return "bfloat16" if compute_dtype == "bfloat16" else "param"
    return kind


def reduce_dtype(wire: str, compute_dtype: str | None) -> str:
    """What fsdp's gradient reduce-scatters move when weights are gathered as ``wire``
    (:func:`gather_dtype`'s answer): ``"param"`` (as stored, with weights gathered as stored),
    ``"bfloat16"`` for bfloat16 gathers, the compute dtype for int8's (see the module
    docstring: the reduction is the weight-gradient matmul's)."""
    if wire in ("param", "bfloat16"):
        return wire
    return compute_dtype or "float32"


def wire_itemsize(dtype: str, stored: int, upcasts_16bit: bool = False) -> int:
    """Bytes per element a gather or reduction of ``dtype`` moves for a parameter stored with
    ``stored`` bytes per element (``upcasts_16bit``: a backend that widens 16-bit collectives
    to float32, XLA:CPU)."""
    size = stored if dtype == "param" else WIRE_ITEMSIZE[dtype]
    return 4 if upcasts_16bit and size == 2 else size


def weight_gather(wire: str, compute_dtype: str | None, mesh: Mesh,
                  rules: Sequence) -> WeightGather | None:
    """The gather policy moving ``wire`` (:func:`gather_dtype`'s answer) on ``mesh``, handing
    the model ``compute_dtype`` values; None when weights are gathered as stored."""
    if wire == "param" or int(dict(mesh.shape).get(FSDP, 1)) == 1:
        return None
    if wire not in KINDS:
        raise ValueError(f"unknown gather dtype {wire!r}")
    out = compute_dtype or ("bfloat16" if wire == "bfloat16" else "float32")
    return WeightGather(wire, out, mesh, sharding.normalize_rules(rules))
