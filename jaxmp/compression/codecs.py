"""The compressed collectives of a gradient reduction, written for one device's view.

Everything here runs inside ``jax.shard_map`` with every mesh axis manual: each function sees
this device's shard of the gradients and talks to the other data replicas with explicit
collectives over the ``data`` axis. :mod:`jaxmp.compression.reduce` builds the shard_map around
them.

* :func:`two_phase_sum` — an all-reduce as a reduce-scatter then an all-gather, each moving an
  encoded payload: ``bf16`` (16 bits a value) or ``int8`` (8 bits plus one float32 scale per
  block of values). The reduce-scatter is an ``all_to_all`` of encoded blocks followed by a
  *local* float32 sum of the decoded blocks, so the sum can neither overflow nor lose bits to
  a low-precision accumulator; the owner then re-encodes its summed block for the all-gather.
  Both quantization errors are returned so error feedback can keep them.
* :func:`powersgd` — rank-r PowerSGD (Vogels et al., 2019) of one batch of matrices whose rows
  and columns may themselves be split over other mesh axes (fsdp / tensor).

bf16 payloads travel as ``uint16`` bit patterns: XLA's CPU backend widens bf16 collectives to
float32, integers it moves as they are, and on GPUs the bytes are the same either way.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

DATA = "data"
Payload = tuple[jax.Array, ...]


def encode(x: jax.Array, kind: str, block: int) -> Payload:
    """Encode rows ``x [R, C]`` (float32) for the wire; C is a multiple of ``block``."""
    if kind == "bfloat16":
        return (jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16),)
    blocks = x.reshape(x.shape[0], -1, block)
    amax = jnp.max(jnp.abs(blocks), axis=-1)
    scale = jnp.where(amax > 0, amax / 127.0, 1.0).astype(jnp.float32)
    q = jnp.clip(jnp.round(blocks / scale[..., None]), -127, 127).astype(jnp.int8)
    return q.reshape(x.shape), scale


def decode(payload: Payload, kind: str, block: int) -> jax.Array:
    """Float32 values of an encoded ``[R, C]`` payload (the inverse of :func:`encode`)."""
    if kind == "bfloat16":
        return jax.lax.bitcast_convert_type(payload[0], jnp.bfloat16).astype(jnp.float32)
    q, scale = payload
    rows = q.reshape(q.shape[0], -1, block).astype(jnp.float32) * scale[..., None]
    return rows.reshape(q.shape)


def padded_length(n: int, replicas: int, block: int) -> int:
    """``n`` rounded up so that every replica owns a whole number of blocks."""
    unit = replicas * block
    return -(-n // unit) * unit


def two_phase_sum(x: jax.Array, kind: str, block: int, replicas: int
                  ) -> tuple[jax.Array, jax.Array]:
    """Sum the flat ``x`` over the data replicas with encoded payloads: ``(sum, error)``.

    ``x`` is padded to :func:`padded_length`; ``error`` (same shape) is what this device's
    encodings dropped: its own values' encoding error, plus the re-encoding error of the block
    it owns. Over all replicas, ``sum(x) == result + sum(error)`` up to float32 rounding —
    the invariant error feedback relies on.
    """
    block = block if kind == "int8" else 1
    rows = x.reshape(replicas, -1)
    sent = encode(rows, kind, block)
    received = tuple(jax.lax.all_to_all(p, DATA, 0, 0) for p in sent)
    owned = jnp.sum(decode(received, kind, block), axis=0)  # float32: no overflow, no bf16 sum
    again = encode(owned[None], kind, block)
    gathered = tuple(jax.lax.all_gather(p, DATA, axis=0, tiled=True) for p in again)
    total = decode(gathered, kind, block).reshape(-1)
    error = rows - decode(sent, kind, block)
    mine = jax.lax.axis_index(DATA)
    error = error.at[mine].add(owned - decode(again, kind, block)[0])
    return total, error.reshape(-1)


def _psum(x: jax.Array, axes: Sequence[str]) -> jax.Array:
    return jax.lax.psum(x, tuple(axes)) if axes else x


def orthonormal(p: jax.Array, row_axes: Sequence[str]) -> jax.Array:
    """An orthonormal basis of the columns of ``p [B, n, r]`` whose rows are split over
    ``row_axes``: the small matrix is gathered, orthonormalised and sliced back."""
    if not row_axes:
        return gram_schmidt(p)
    axes = tuple(row_axes)
    full = jax.lax.all_gather(p, axes, axis=1, tiled=True)
    q = gram_schmidt(full)
    start = jax.lax.axis_index(axes) * p.shape[1]
    return jax.lax.dynamic_slice_in_dim(q, start, p.shape[1], axis=1)


_DEPENDENT = 1e-3  # what is left of a column after projection, relative to it


def gram_schmidt(p: jax.Array) -> jax.Array:
    """Orthonormal columns of ``p [B, n, r]`` by modified Gram–Schmidt, as the PowerSGD paper
    does: r is small, so r²/2 vector operations, and no LAPACK call (OpenBLAS's threaded QR
    deadlocked when several simulated CPU devices called it at once, from rank 12 up). A
    column that is (numerically) in the span of the ones before becomes zero: normalising what
    rounding left of it would give a column that is not orthogonal to them."""
    cols: list[jax.Array] = []
    for j in range(p.shape[-1]):
        v = p[..., j]
        before = jnp.sqrt(jnp.sum(v * v, axis=-1, keepdims=True))
        for q in cols:
            v = v - jnp.sum(q * v, axis=-1, keepdims=True) * q
        norm = jnp.sqrt(jnp.sum(v * v, axis=-1, keepdims=True))
        independent = norm > _DEPENDENT * before
        cols.append(jnp.where(independent, v / jnp.where(independent, norm, 1.0), 0.0))
    return jnp.stack(cols, axis=-1)


def powersgd(m: jax.Array, q: jax.Array, row_axes: Sequence[str], col_axes: Sequence[str]
             ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One PowerSGD round for this device's block ``m [B, n, m]`` of a batch of matrices.

    ``q [B, m, r]`` is the warm start (last step's Q, same column split as ``m``). Returns
    ``(approx, local, q)``: the rank-r approximation of the sum over data replicas, this
    replica's own share of it (for error feedback: ``m - local``) and the next warm start.
    Bytes over ``data``: one all-reduce of P ``[B, n, r]`` and one of Q ``[B, m, r]``.
    """
    p = _psum(jnp.einsum("bnm,bmr->bnr", m, q), (*col_axes, DATA))
    p = orthonormal(p, row_axes)
    q_mine = _psum(jnp.einsum("bnm,bnr->bmr", m, p), row_axes)
    q_all = jax.lax.psum(q_mine, DATA)
    approx = jnp.einsum("bnr,bmr->bnm", p, q_all)
    local = jnp.einsum("bnr,bmr->bnm", p, q_mine)
    return approx, local, q_all
