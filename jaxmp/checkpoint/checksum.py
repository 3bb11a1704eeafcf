"""Per-array checksums in a checkpoint's meta, so that bits damaged on disk are caught.

Orbax stores raw array bytes with no checksum (jaxmp writes them uncompressed), so a flipped bit
would read back as a different number: a resumed run silently corrupted. Each array's record
therefore carries ``"checksum"``: two sums over its bit patterns as uint32 words, modulo 2**32 —
``Σ w_i`` and ``Σ (i+1)·w_i`` over the flat C-order index ``i``. Sums modulo 2**32 do not depend
on the order of addition, so the value is the same computed on a sharded ``jax.Array`` (one
reduction on the devices, at save and at restore) or on a numpy array (``jaxmp ckpt inspect``,
export), on any mesh or process count. Any single flipped bit changes the first sum; moved
elements change the second.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxmp.errors import DamagedCheckpoint

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32}  # 8-byte dtypes (x64) carry no checksum
KEY = "checksum"


def _supported(dtype: Any) -> bool:
    return np.dtype(dtype) == np.bool_ or np.dtype(dtype).itemsize in _UINT


def _stats_one(x: jax.Array) -> jax.Array:
    """uint32[3]: all finite (1/0), then the two sums (zeros for a dtype with no checksum)."""
    finite = jnp.isfinite(x).all() if jnp.issubdtype(x.dtype, jnp.inexact) else True
    if not _supported(x.dtype):
        return jnp.stack([jnp.uint32(finite), jnp.uint32(0), jnp.uint32(0)])
    if x.dtype == jnp.bool_:
        words = x.astype(jnp.uint32)
    else:
        words = jax.lax.bitcast_convert_type(x, _UINT[x.dtype.itemsize]).astype(jnp.uint32)
    index = jnp.arange(1, x.size + 1, dtype=jnp.uint32).reshape(x.shape)
    return jnp.stack([jnp.asarray(finite, jnp.uint32), jnp.sum(words, dtype=jnp.uint32),
                      jnp.sum(words * index, dtype=jnp.uint32)])


def _program(values: Sequence[Any]) -> Any:
    """One jitted program for every array; its result replicated (readable on every process)."""
    shardings = [getattr(v, "sharding", None) for v in values]
    mesh = next((s.mesh for s in shardings if isinstance(s, NamedSharding)), None)
    out = NamedSharding(mesh, PartitionSpec()) if mesh is not None else None
    return jax.jit(lambda xs: jnp.stack([_stats_one(x) for x in xs]), out_shardings=out)


class ArrayStats:
    """Per array: all finite? and its checksum — one program over the whole state.

    Given abstract arrays (``jax.ShapeDtypeStruct`` with shardings) it compiles ahead, so a
    run pays the compile at start-up, where every process compiles anyway, instead of at its
    first save (on several processes a late compile there can outlast gloo's 30 s for the
    processes to meet in a new program).
    """

    def __init__(self, abstract: Sequence[jax.ShapeDtypeStruct] | None = None):
        self._compiled = _program(abstract).lower(list(abstract)).compile() if abstract else None

    def __call__(self, values: Sequence[Any]) -> tuple[list[bool], list[str | None]]:
        values = list(values)
        if not values:
            return [], []
        run = self._compiled or _program(values)
        rows = np.asarray(run(values))
        return ([bool(r[0]) for r in rows],
                [f"{int(r[1]):08x}{int(r[2]):08x}" if _supported(v.dtype) else None
                 for r, v in zip(rows, values)])


def checksums(values: Sequence[Any]) -> list[str | None]:
    """Checksums of arrays (jax or numpy), computed where they live; None for 8-byte dtypes.

    On several processes every process must call it (the sums are global reductions).
    """
    return ArrayStats()(values)[1]


def checksum_numpy(a: np.ndarray) -> str | None:
    """The same checksum for a host array (no device work, no array-sized temporaries)."""
    if not _supported(a.dtype):
        return None
    return from_sums(*block_sums(a, (0,) * a.ndim, a.shape))


def block_sums(block: np.ndarray, start: Sequence[int], shape: Sequence[int]) -> tuple[int, int]:
    """The two sums (mod 2**64) over ``block``, the part of an array of ``shape`` whose first
    element sits at ``start``. Blocks that tile the array add up, mod 2**32, to its checksum
    (:func:`from_sums`), so it can be computed on the host while the array is assembled
    piece by piece, never whole. ``Σ (i+1)·w`` splits over dims: ``i = Σ_d c_d·stride_d``, so
    it needs only the block's sum and its marginal sums along each dim (no index array)."""
    words = np.ascontiguousarray(block)
    words = words.view(np.uint8) if words.dtype == np.bool_ else \
        words.view(_UINT[words.dtype.itemsize])
    total = int(words.sum(dtype=np.uint64))
    weighted, stride = total, 1
    for d in reversed(range(len(shape))):
        others = tuple(k for k in range(words.ndim) if k != d)
        marginal = words.sum(axis=others, dtype=np.uint64) if others else words.astype(np.uint64)
        coords = int(np.dot(np.arange(words.shape[d], dtype=np.uint64), marginal))
        weighted += stride * (start[d] * total + coords)
        stride *= shape[d]
    return total % 2**64, weighted % 2**64


def from_sums(total: int, weighted: int) -> str:
    """A checksum record from :func:`block_sums` added over an array's blocks."""
    return f"{total % 2**32:08x}{weighted % 2**32:08x}"


def verify(where: str, records: Mapping[str, Mapping[str, Any]], paths: Sequence[str],
           got: Sequence[str | None]) -> None:
    """Raise :class:`DamagedCheckpoint` for the first array whose checksum differs from its
    record (records without one, from older checkpoints, are not checked)."""
    for path, value in zip(paths, got):
        want = records.get(path, {}).get(KEY)
        if want is not None and value is not None and want != value:
            raise DamagedCheckpoint(f"checkpoint {where}: array {path} does not match its "
                                    f"checksum (its files are corrupted)")
