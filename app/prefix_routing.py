"""Prefix-aware routing across pipelines: which replica most likely holds a prompt's prefix
in its prefix cache (pure Python; app/prefix_router.py is the Ray Serve glue).

A prompt's routing key names its prefixes of 1, 2, 4, ... full blocks and of all its full
blocks, each by one hash of everything up to that point: a few hashes whatever the prompt's
length, and a shared prefix is found to within a factor of two. Blocks are `block_size` units
of what the ingress has: token ids for a token-id prompt, UTF-8 bytes of the text otherwise
(chat messages in a canonical rendering), since tokenization happens in the replica. The
router remembers, per replica, the hashes of the prompts it was sent (a bounded LRU) and ranks
the replicas for each request: those holding the longest prefix first unless saturated, then
the least loaded.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

_DIGEST_BYTES = 8  # a routing key only steers load: a rare collision costs one cache miss


@dataclass(frozen=True)
class PrefixKey:
    """hashes[i] names the prompt's first blocks[i] full blocks; blocks increase."""

    blocks: tuple[int, ...] = ()
    hashes: tuple[bytes, ...] = ()

    @property
    def num_blocks(self) -> int:
        return self.blocks[-1] if self.blocks else 0


def key_levels(num_blocks: int) -> list[int]:
    """1, 2, 4, ... up to num_blocks, and num_blocks itself."""
    levels, n = [], 1
    while n < num_blocks:
        levels.append(n)
        n *= 2
    return levels + [num_blocks] if num_blocks else []


def prefix_key(data: bytes, block_bytes: int) -> PrefixKey:
    """The key of `data` cut into blocks of `block_bytes` bytes (a partial last one ignored)."""
    levels = key_levels(len(data) // block_bytes)
    h = hashlib.blake2b(digest_size=_DIGEST_BYTES)
    hashes, done = [], 0
    for n in levels:
        h.update(data[done * block_bytes : n * block_bytes])
        done = n
        hashes.append(h.copy().digest())
    return PrefixKey(tuple(levels), tuple(hashes))


def prompt_key(
    prompt: str | Sequence[int] | None,
    messages: Sequence[Mapping[str, Any]] | None,
    block_size: int,
) -> PrefixKey:
    """The routing key of a completion prompt (text or token ids) or of chat messages."""
    if messages is not None:
        text = "".join(f"<|{m.get('role')}|>\n{m.get('content')}\n" for m in messages)
        return prefix_key(text.encode("utf-8", "surrogatepass"), block_size)
    if isinstance(prompt, str):
        return prefix_key(prompt.encode("utf-8", "surrogatepass"), block_size)
    if prompt is None:
        return PrefixKey()
    try:  # 8 bytes per id: any vocabulary fits
        data = array("q", prompt).tobytes()
    except (OverflowError, TypeError):  # not token ids the replica will accept either
        return PrefixKey()
    return prefix_key(data, 8 * block_size)


class PrefixRoutingTable:
    """Per replica, the key hashes of the prompts sent to it (LRU, `capacity` each), and the
    ranking of replicas for a new key.

    A replica is preferred when it holds at least `min_match` of the prompt's full blocks and is
    not saturated (its queue length below `max_queue`); the rest follow, least loaded first.
    Ties: fewer remembered hashes first (spreads new prefixes), then the order given.
    """

    def __init__(self, max_queue: int, capacity: int = 4096, min_match: float = 0.1) -> None:
        if max_queue < 1 or capacity < 1 or not 0.0 <= min_match <= 1.0:
            raise ValueError(
                f"need max_queue >= 1, capacity >= 1, 0 <= min_match <= 1; got {max_queue}, "
                f"{capacity}, {min_match}"
            )
        self.max_queue = max_queue
        self.capacity = capacity
        self.min_match = min_match
        self._seen: dict[str, OrderedDict[bytes, None]] = {}

    def matched_blocks(self, replica: str, key: PrefixKey) -> int:
        """Full blocks of the longest prefix of `key` that `replica` was sent."""
        seen = self._seen.get(replica)
        if not seen:
            return 0
        for n, h in zip(reversed(key.blocks), reversed(key.hashes), strict=True):
            if h in seen:
                return n
        return 0

    def rank(self, key: PrefixKey | None, queue_lens: Mapping[str, int | None]) -> list[str]:
        """Every replica of `queue_lens` (None: unknown, taken as idle), most preferred first."""
        load = {r: q or 0 for r, q in queue_lens.items()}
        order = {r: i for i, r in enumerate(queue_lens)}
        size = {r: len(self._seen.get(r, ())) for r in queue_lens}
        matched: dict[str, int] = {}
        if key is not None and key.num_blocks:
            need = max(1.0, self.min_match * key.num_blocks)
            for r in queue_lens:
                m = self.matched_blocks(r, key)
                if m >= need and load[r] < self.max_queue:
                    matched[r] = m
        preferred = sorted(matched, key=lambda r: (-matched[r], load[r], size[r], order[r]))
        rest = sorted(
            (r for r in queue_lens if r not in matched),
            key=lambda r: (load[r], size[r], order[r]),
        )
        return preferred + rest

    def record(self, replica: str, key: PrefixKey | None) -> None:
        """`replica` was sent a prompt with this key: it now caches those prefixes."""
        if key is None or not key.hashes:
            return
        seen = self._seen.setdefault(replica, OrderedDict())
        for h in key.hashes:
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.capacity:
            seen.popitem(last=False)

    def retain(self, replicas: Iterable[str]) -> None:
        """Forget every replica not in `replicas` (gone, or replaced after a failure)."""
        keep = set(replicas)
        for r in [r for r in self._seen if r not in keep]:
            del self._seen[r]

    def forget(self, replica: str) -> None:
        self._seen.pop(replica, None)
