"""Byte sizes of arrays, abstract arrays and whole pytrees (typed PRNG keys included)."""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np


def nbytes(x: Any) -> int:
    """Bytes of an array, ``ShapeDtypeStruct``, aval or scalar; a typed PRNG key counts its key
    data (what a checkpoint stores); anything without a shape or dtype counts 0."""
    dtype, shape = getattr(x, "dtype", None), getattr(x, "shape", None)
    if dtype is None or shape is None:
        if not isinstance(x, (int, float, complex, bool, np.generic)):
            return 0
        arr = np.asarray(x)
        dtype, shape = arr.dtype, arr.shape
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(shape, dtype))
        return nbytes(data)
    return math.prod(shape) * np.dtype(dtype).itemsize


def tree_bytes(tree: Any) -> int:
    """Total bytes of every array in ``tree`` (global sizes, not per device)."""
    return sum(nbytes(x) for x in jax.tree.leaves(tree))
