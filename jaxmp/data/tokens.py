"""Random-access token containers: a stored 1-D array, or a synthetic stream computed on demand.

Every source (:mod:`jaxmp.data.sources`) opens as one of these; the batch iterator
(:mod:`jaxmp.data.batches`) needs only ``n_tokens``, ``fingerprint`` and ``gather``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

SYNTHETIC_TOKENS = 2**30  # virtual length of the synthetic stream (never materialised)


@dataclass(frozen=True)
class ArrayTokens:
    """A 1-D token array (usually a read-only memmap) with a fingerprint naming its content.

    ``label`` names the source for people (a file path), ``fingerprint`` identifies its content.
    """

    tokens: np.ndarray
    fingerprint: str
    label: str = ""

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.shape[0])

    def gather(self, starts: np.ndarray, length: int) -> np.ndarray:
        """Rows ``tokens[start:start+length]``; fancy indexing reads only the pages it touches."""
        return np.asarray(self.tokens[starts[:, None] + np.arange(length)], dtype=np.int32)


@dataclass(frozen=True)
class SyntheticTokens:
    """Random tokens defined by a hash of (key, position): random access, nothing stored."""

    key: int
    vocab_size: int
    fingerprint: str
    n_tokens: int = SYNTHETIC_TOKENS

    @property
    def label(self) -> str:
        return self.fingerprint

    def gather(self, starts: np.ndarray, length: int) -> np.ndarray:
        pos = (starts[:, None] + np.arange(length)).astype(np.uint64)
        return (_splitmix64(pos ^ np.uint64(self.key)) % np.uint64(self.vocab_size)).astype(np.int32)


Tokens = ArrayTokens | SyntheticTokens


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser: a cheap, well-mixed bijection on uint64 (wraps on purpose)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def stable_hash(*parts: object, bits: int = 32) -> int:
    """A stable hash (Python's ``hash`` is salted per process, so unusable here)."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=bits // 8).digest()
    return int.from_bytes(digest, "little")
