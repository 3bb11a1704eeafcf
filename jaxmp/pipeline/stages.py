"""Which layers each pipeline chunk holds, and how a stacked layer axis is laid out over stages.

A model is pipelined as ``pre`` (e.g. the embedding) → a stack of blocks → ``post`` (e.g. the
head and the loss); the cost model's per-layer table has the same order (``pre``, every block,
``post``). A split cuts that table into ``P·V`` contiguous chunks — by per-layer FLOPs
(:func:`jaxmp.pipeline.balance.balance_stages`), so a chunk that also runs a large-vocabulary
head gets fewer blocks — or by layer count. Chunk ``c`` runs on device ``c % P``.

Chunks hold different numbers of blocks, but a sharded array must split evenly, so the stacked
block parameters are stored padded: ``[P, V·Lmax, ...]`` with the ``stage`` dim sharded over the
``stage`` mesh axis and ``Lmax`` the most blocks any chunk holds. :attr:`StageSplit.rows` maps
each padded row to its block (or -1: padding, which no stage ever computes). Checkpoints record
that map, so a run restores in the plain ``[L, ...]`` layout on any mesh, and back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from jaxmp.config import BALANCES
from jaxmp.errors import ConfigError
from jaxmp.pipeline.balance import InfeasibleError, balance_stages



@dataclass(frozen=True)
class StageSplit:
    """``bounds[c] = (start, end)`` over the per-layer table (``pre``, blocks, ``post``)."""

    stages: int
    virtual: int
    bounds: tuple[tuple[int, int], ...]
    n_blocks: int

    def __post_init__(self) -> None:
        ends = [b for _, b in self.bounds]
        starts = [a for a, _ in self.bounds]
        if len(self.bounds) != self.stages * self.virtual or starts[0] != 0 or \
                ends[-1] != self.n_blocks + 2 or starts[1:] != ends[:-1]:
            raise ValueError(f"stage bounds {self.bounds} do not cover the {self.n_blocks + 2} "
                             f"layers in {self.stages * self.virtual} contiguous chunks")

    @property
    def chunks(self) -> int:
        return self.stages * self.virtual

    def blocks_of(self, chunk: int) -> range:
        """Indices (into the block stack) of the blocks chunk ``chunk`` runs."""
        a, b = self.bounds[chunk]
        return range(max(a, 1) - 1, min(b, self.n_blocks + 1) - 1)

    @property
    def per_chunk(self) -> list[int]:
        return [len(self.blocks_of(c)) for c in range(self.chunks)]

    @property
    def max_blocks(self) -> int:
        """``Lmax``: the padded rows per chunk (at least 1, so every stack has a row)."""
        return max(1, max(self.per_chunk))

    @property
    def counts(self) -> np.ndarray:
        """``[P, V]``: blocks that device d's local chunk v runs."""
        out = np.zeros((self.stages, self.virtual), np.int32)
        for c in range(self.chunks):
            out[c % self.stages, c // self.stages] = len(self.blocks_of(c))
        return out

    @property
    def rows(self) -> np.ndarray:
        """``[P, V·Lmax]``: the block each padded row holds, -1 for padding."""
        lmax = self.max_blocks
        out = np.full((self.stages, self.virtual * lmax), -1, np.int64)
        for c in range(self.chunks):
            d, v = c % self.stages, c // self.stages
            for i, block in enumerate(self.blocks_of(c)):
                out[d, v * lmax + i] = block
        return out

    def flat_index(self) -> np.ndarray:
        """For each block, its row in the flattened padded stack ``[P·V·Lmax]``."""
        flat = self.rows.reshape(-1)
        index = np.empty(self.n_blocks, np.int64)
        index[flat[flat >= 0]] = np.flatnonzero(flat >= 0)
        return index


def split_layers(costs: Sequence[float], stages: int, virtual: int = 1,
                 balance: str = "flops") -> StageSplit:
    """Split the per-layer table (``pre``, blocks, ``post``) into ``stages·virtual`` chunks.

    ``balance="flops"`` minimises the slowest chunk's cost; ``"layers"`` gives every chunk the
    same number of table entries (the embedding and the head count as one each), as a
    layer-count split would.
    """
    n = len(costs)
    chunks = stages * virtual
    if balance not in BALANCES:
        raise ConfigError(f"pipeline.balance: must be one of {', '.join(BALANCES)}, "
                          f"got {balance!r}")
    if n - 2 < chunks:
        raise ConfigError(f"pipeline: {n - 2} blocks cannot fill {stages} stages x {virtual} "
                          f"virtual stages (model.layers must be >= stages x virtual stages)")
    if balance == "layers":
        cuts = np.linspace(0, n, chunks + 1).round().astype(int)
        bounds = list(zip(cuts[:-1].tolist(), cuts[1:].tolist()))
    else:
        try:
            bounds = balance_stages(costs, chunks)
        except InfeasibleError as e:  # pragma: no cover - guarded by the count check above
            raise ConfigError(f"pipeline: {e}") from None
    return StageSplit(stages, virtual, tuple((int(a), int(b)) for a, b in bounds), n - 2)
