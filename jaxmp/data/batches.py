"""Deterministic global batches from a token source, and per-process reading.

The stream is defined globally so a run is reproducible whatever the hardware: a source is a 1-D
token array cut into non-overlapping windows of ``seq_len + 1`` tokens (stride ``seq_len``, so an
epoch is every window once); Grain shuffles the window order per epoch from the seed; the global
batch at step ``s`` is rows ``[s*B, (s+1)*B)`` of that shuffled stream. Process ``p`` of ``P``
reads only its contiguous ``B/P`` rows, and the iterator state is just the global step, so a run
resumed on a different number of processes or devices continues the same batches.
"""

from __future__ import annotations

from typing import Any

import grain
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxmp.data.sources import open_tokens
from jaxmp.data.tokens import Tokens, stable_hash
from jaxmp.errors import DataError

_STATE_KEYS = ("seed", "global_batch", "seq_len", "fingerprint")
class BatchIterator:
    """This process's rows of the global batch stream; state is the global step only.

    ``__next__`` returns ``{"inputs", "targets"}`` as ``int32[global_batch / process_count,
    seq_len]``; ``targets`` are ``inputs`` shifted by one token.
    """

    def __init__(self, tokens: Tokens, *, seq_len: int, global_batch: int, seed: int,
                 process_index: int, process_count: int, name: str | None = None) -> None:
        if seq_len < 1 or global_batch < 1:
            raise DataError(f"seq_len and global_batch must be >= 1, got {seq_len}, {global_batch}")
        if process_count < 1 or not 0 <= process_index < process_count:
            raise DataError(f"process_index {process_index} is not in [0, {process_count})")
        if global_batch % process_count:
            raise DataError(f"global batch {global_batch} is not divisible by the process count "
                            f"{process_count}; every process must read the same number of rows")
        self.n_windows = (tokens.n_tokens - 1) // seq_len
        if self.n_windows < 1:
            raise DataError(f"{name or 'source ' + (tokens.label or tokens.fingerprint)} has {tokens.n_tokens} "
                            f"tokens, fewer than one window of seq_len + 1 = {seq_len + 1}")
        self.tokens, self.seq_len, self.global_batch, self.seed = tokens, seq_len, global_batch, seed
        self.process_index, self.process_count = process_index, process_count
        self.local_batch = global_batch // process_count
        self.step = 0
        # Hash the user seed: Grain reseeds epoch e with seed + e, so raw seeds s and s+1 would
        # give the same permutations shifted by one epoch.
        self._order = grain.MapDataset.range(self.n_windows).shuffle(
            seed=stable_hash("jaxmp-shuffle", seed)).repeat()

    def __iter__(self) -> BatchIterator:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        first = self.step * self.global_batch + self.process_index * self.local_batch
        windows = np.fromiter((self._order[i] for i in range(first, first + self.local_batch)),
                              dtype=np.int64, count=self.local_batch)
        rows = self.tokens.gather(windows * self.seq_len, self.seq_len + 1)
        self.step += 1
        return {"inputs": rows[:, :-1], "targets": rows[:, 1:]}

    def get_state(self) -> dict[str, Any]:
        """JSON-able: the next global step and what identifies the stream (no process layout)."""
        return {"step": self.step, "seed": self.seed, "global_batch": self.global_batch,
                "seq_len": self.seq_len, "fingerprint": self.tokens.fingerprint}

    def set_state(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; refuses a state from a different stream."""
        mine = self.get_state()
        for key in _STATE_KEYS:
            if state.get(key) != mine[key]:
                raise DataError(f"data state does not match this stream: {key} is "
                                f"{state.get(key)!r} in the state but {mine[key]!r} here")
        step = state.get("step")
        if not isinstance(step, int) or step < 0:
            raise DataError(f"data state step must be a non-negative integer, got {step!r}")
        self.step = step


def make_batches(source: str, *, seq_len: int, global_batch: int, seed: int, vocab_size: int,
                 split: str = "train", token_dtype: str = "uint16", eval_fraction: float = 0.01,
                 process_index: int | None = None, process_count: int | None = None,
                 ) -> BatchIterator:
    """The batch iterator for ``source`` ('stdlib', 'synthetic', a .bin path or a prepared
    folder) on this process."""
    tokens = open_tokens(source, split=split, vocab_size=vocab_size, seed=seed,
                         token_dtype=token_dtype, eval_fraction=eval_fraction)
    return BatchIterator(
        tokens, seq_len=seq_len, global_batch=global_batch, seed=seed,
        name=f"the {split} split of data.source {source}",
        process_index=jax.process_index() if process_index is None else process_index,
        process_count=jax.process_count() if process_count is None else process_count)


def to_global(batch: dict[str, np.ndarray], mesh: Mesh,
              spec: PartitionSpec = PartitionSpec(("data", "fsdp"))) -> dict[str, jax.Array]:
    """Assemble global arrays from every process's local rows (``BatchIterator`` output).

    The local rows must be the devices' contiguous slice of the global batch, process ``p``
    holding rows ``[p*n, (p+1)*n)``: true for ``jaxmp.make_mesh`` meshes, whose batch axes are
    outermost and span hosts first. Mesh axes not in ``spec`` (e.g. ``tensor``) replicate the
    batch. A layout that breaks this raises instead of silently training on wrong rows.
    """
    sharding = NamedSharding(mesh, spec)
    batch_axes = spec[0] if spec and spec[0] is not None else ()
    shards = int(np.prod([mesh.shape[a] for a in np.atleast_1d(batch_axes)]))
    p, n_proc = jax.process_index(), jax.process_count()
    if n_proc == 1:  # the local rows are the global batch: one transfer call for all arrays
        for name, local in batch.items():
            if local.shape[0] % shards:
                raise DataError(f"global batch {local.shape[0]} is not divisible by the "
                                f"{shards} batch shards of mesh axes {batch_axes}")
        return jax.device_put(batch, sharding)
    out = {}
    for name, local in batch.items():
        n = local.shape[0]
        global_shape = (n * n_proc, *local.shape[1:])
        if global_shape[0] % shards:
            raise DataError(f"global batch {global_shape[0]} is not divisible by the {shards} "
                            f"batch shards of mesh axes {batch_axes}")
        rows = [idx[0] for idx in sharding.addressable_devices_indices_map(global_shape).values()]
        lo = min(r.start or 0 for r in rows)
        hi = max(global_shape[0] if r.stop is None else r.stop for r in rows)
        if (lo, hi) != (p * n, (p + 1) * n):
            raise DataError(f"process {p}'s devices need batch rows [{lo}, {hi}) but it read "
                            f"[{p * n}, {(p + 1) * n}): the batch axes {batch_axes} must split the "
                            f"batch across processes, in process order")
        out[name] = jax.make_array_from_process_local_data(sharding, local, global_shape)
    return out
