"""Stable names for prefix-cache blocks, and a compact summary of the blocks an engine holds.

A full block is named by a 64-bit chain hash of (parent's name, its token ids, cache salt,
adapter). It is stable across processes and machines (blake2b, not Python's salted `hash`),
so a gateway that tokenizes a request the same way computes the same names and can ask each
worker's summary how much of the request's prefix that worker already holds.

The summary is a Bloom filter of the names of the blocks an engine has cached: a few KiB for
thousands of blocks, sent in `/stats`. A false positive (about 1% at the default size) can
only make routing over-estimate one block of affinity; it never serves wrong KV, since the
engine checks each hit against the block's stored tokens.
"""

from __future__ import annotations

import base64
import hashlib
import math
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

BlockKey = tuple[int | None, tuple[int, ...], str | None, int | None]


def block_hash(key: BlockKey) -> int:
    """The block's name: the same for the same key in every process."""
    parent, tokens, salt, adapter = key
    h = hashlib.blake2b(digest_size=8)
    h.update(b"\x00" * 9 if parent is None else b"\x01" + parent.to_bytes(8, "little"))
    h.update(len(tokens).to_bytes(4, "little"))
    h.update(array("q", tokens).tobytes())
    h.update(b"\x00" if salt is None else b"\x01" + salt.encode())
    h.update(b"\x00" if adapter is None else b"\x01" + adapter.to_bytes(8, "little", signed=True))
    return int.from_bytes(h.digest(), "little")


def chain_hashes(token_ids: Sequence[int], block_size: int, salt: str | None,
                 adapter: int | None = None, *, limit: int | None = None) -> list[int]:
    """Names of the prompt's full blocks, in order, as the engine's block manager names them
    (a prompt's last token is always computed, so its block is never a hit: left out)."""
    num_blocks = (len(token_ids) - 1) // block_size
    if limit is not None:
        num_blocks = min(num_blocks, limit)
    names: list[int] = []
    parent: int | None = None
    for i in range(num_blocks):
        tokens = tuple(token_ids[i * block_size : (i + 1) * block_size])
        parent = block_hash((parent, tokens, salt, adapter))
        names.append(parent)
    return names


@dataclass(frozen=True)
class PrefixSummary:
    """A Bloom filter over block names, with the block size it counts in."""

    block_size: int
    num_bits: int
    num_hashes: int
    bits: bytes

    @classmethod
    def build(cls, names: Iterable[int], block_size: int, *, capacity: int,
              false_positive_rate: float = 0.01) -> PrefixSummary:
        capacity = max(capacity, 1)
        num_bits = max(64, math.ceil(-capacity * math.log(false_positive_rate) / math.log(2) ** 2))
        num_bits = -(-num_bits // 8) * 8
        num_hashes = min(32, max(1, round(num_bits / capacity * math.log(2))))
        bits = np.zeros(num_bits // 8, dtype=np.uint8)
        arr = np.fromiter(names, dtype=np.uint64)
        low, high = arr & np.uint64(0xFFFFFFFF), (arr >> np.uint64(32)) | np.uint64(1)
        for i in range(num_hashes):  # the same positions as `_positions`, vectorised
            pos = (low + np.uint64(i) * high) % np.uint64(num_bits)
            np.bitwise_or.at(bits, (pos >> np.uint64(3)).astype(np.intp),
                             np.left_shift(1, (pos & np.uint64(7)).astype(np.uint8)))
        return cls(block_size, num_bits, num_hashes, bits.tobytes())

    def __contains__(self, name: int) -> bool:
        return all(self.bits[p >> 3] & (1 << (p & 7))
                   for p in _positions(name, self.num_bits, self.num_hashes))

    def cached_blocks(self, names: Sequence[int]) -> int:
        """How many of the leading blocks are (probably) held: a chain stops at its first miss."""
        for i, name in enumerate(names):
            if name not in self:
                return i
        return len(names)

    def to_json(self) -> dict[str, Any]:
        return {"block_size": self.block_size, "num_bits": self.num_bits,
                "num_hashes": self.num_hashes, "bits": base64.b64encode(self.bits).decode()}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PrefixSummary:
        """Raises ValueError on anything malformed (a summary comes over the network)."""
        try:
            summary = cls(int(data["block_size"]), int(data["num_bits"]),
                          int(data["num_hashes"]), base64.b64decode(data["bits"], validate=True))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed prefix summary: {exc}") from None
        if (summary.block_size < 1 or summary.num_hashes < 1 or summary.num_hashes > 32
                or summary.num_bits != 8 * len(summary.bits) or summary.num_bits < 8):
            raise ValueError("malformed prefix summary: inconsistent sizes")
        return summary


def _positions(name: int, num_bits: int, num_hashes: int) -> Iterable[int]:
    """k positions by double hashing the 64-bit name (its two halves)."""
    low, high = name & 0xFFFFFFFF, (name >> 32) | 1
    return ((low + i * high) % num_bits for i in range(num_hashes))
