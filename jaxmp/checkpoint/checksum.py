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

from jaxmp.errors import DamagedCheckpoint

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32}  # 8-byte dtypes (x64) carry no checksum
KEY = "checksum"


def _supported(dtype: Any) -> bool:
    return np.dtype(dtype) == np.bool_ or np.dtype(dtype).itemsize in _UINT


def _sums_jax(x: jax.Array) -> jax.Array:
    if x.dtype == jnp.bool_:
        words = x.astype(jnp.uint32)
    else:
        words = jax.lax.bitcast_convert_type(x, _UINT[x.dtype.itemsize]).astype(jnp.uint32)
    index = jnp.arange(1, x.size + 1, dtype=jnp.uint32).reshape(x.shape)
    return jnp.stack([jnp.sum(words, dtype=jnp.uint32),
                      jnp.sum(words * index, dtype=jnp.uint32)])


@jax.jit
def _all_sums(xs: list[jax.Array]) -> list[jax.Array]:
    return [_sums_jax(x) for x in xs]


def _fmt(sums: Any) -> str:
    a, b = (int(v) for v in np.asarray(sums).reshape(-1))
    return f"{a:08x}{b:08x}"


def checksums(values: Sequence[Any]) -> list[str | None]:
    """Checksums of arrays (jax or numpy), computed where they live; None for 8-byte dtypes.

    On several processes every process must call it (the sums are global reductions).
    """
    idx = [i for i, v in enumerate(values) if _supported(v.dtype)]
    out: list[str | None] = [None] * len(values)
    if idx:
        for i, sums in zip(idx, _all_sums([jnp.asarray(values[i]) if isinstance(
                values[i], np.ndarray) else values[i] for i in idx])):
            out[i] = _fmt(sums)
    return out


def checksum_numpy(a: np.ndarray) -> str | None:
    """The same checksum for a host array (no device work)."""
    if not _supported(a.dtype):
        return None
    a = np.ascontiguousarray(a)
    words = a.astype(np.uint32) if a.dtype == np.bool_ else \
        a.view(_UINT[a.dtype.itemsize]).astype(np.uint32)
    words = words.reshape(-1)
    index = np.arange(1, words.size + 1, dtype=np.uint32)
    with np.errstate(over="ignore"):
        return f"{int(words.sum(dtype=np.uint32)):08x}{int((words * index).sum(dtype=np.uint32)):08x}"


def verify(where: str, records: Mapping[str, Mapping[str, Any]], paths: Sequence[str],
           got: Sequence[str | None]) -> None:
    """Raise :class:`DamagedCheckpoint` for the first array whose checksum differs from its
    record (records without one, from older checkpoints, are not checked)."""
    for path, value in zip(paths, got):
        want = records.get(path, {}).get(KEY)
        if want is not None and value is not None and want != value:
            raise DamagedCheckpoint(f"checkpoint {where}: array {path} does not match its "
                                    f"checksum (its files are corrupted)")
