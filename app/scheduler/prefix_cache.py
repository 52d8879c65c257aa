"""Content hashes of full KV blocks for prefix caching (docs/ARCHITECTURE.md#kv-cache, vLLM v1's
scheme).

Block i of a sequence is named by hash(name of block i - 1, its block_size token ids), so one
name stands for the whole prefix up to the end of that block: two requests share block i only
if they agree on every token before it. BLAKE2b (16 bytes) keeps collisions out of reach.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

_ROOT = b"ppserve-prefix-cache"


def block_hash(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    h = hashlib.blake2b(parent if parent is not None else _ROOT, digest_size=16)
    h.update(",".join(map(str, tokens)).encode())
    return h.digest()


@dataclass
class BlockHashes:
    """The chained hashes of a growing token sequence's full blocks, computed once each."""

    block_size: int
    hashes: list[bytes] = field(default_factory=list)

    def upto(self, tokens: Sequence[int], num_blocks: int) -> list[bytes]:
        """Hashes of the first `num_blocks` full blocks of `tokens`."""
        bs = self.block_size
        num_blocks = min(num_blocks, len(tokens) // bs)
        while len(self.hashes) < num_blocks:
            i = len(self.hashes)
            parent = self.hashes[-1] if self.hashes else None
            self.hashes.append(block_hash(parent, tokens[i * bs : (i + 1) * bs]))
        return self.hashes[:num_blocks]


@dataclass
class PrefixCacheStats:
    """Prompt tokens looked up at admission and how many of them were found cached (vLLM's
    prefix cache queries / hits, in tokens)."""

    queries: int = 0
    hits: int = 0
