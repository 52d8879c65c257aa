"""The KV block pool: ref-counted block ids, a free list, and reservations.

A request reserves, at admission, every block it can ever need (prompt + max_tokens). Blocks
are then handed out lazily (`allocate`) as its rows reach new positions, always from its own
reservation, so an admitted request never waits for memory and nothing has to be preempted.
With on-demand admission there are no reservations: `take` hands out free blocks and the
scheduler preempts when they run out.

References: `allocate` gives the owner one reference. Each dispatched microbatch `retain`s the
blocks of every request it names and `release`s them when it retires; the owner's reference is
dropped when the request finishes. A block goes back to the free list only at refcount 0, so a
request finished or aborted while a chunk of it is still in flight never lends its blocks to
another request before that chunk has run on every stage.

Prefix caching (docs/ARCHITECTURE.md#kv-cache): a full block whose KV has been written (its
microbatch retired) may be `register`ed under the hash of its contents (prefix_cache.py). At
refcount 0 a hashed block is not free-listed but kept, evictable, in least-recently-released order;
it still counts as free, and is evicted (its hash dropped) only when a fresh block is needed and no
unhashed free block is left. `lookup` finds a block by hash, `touch` takes a reference on it
(reviving it from the evictable set if it had none). At most one block holds a given hash.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable


class BlockPoolError(RuntimeError):
    """A block pool misuse: over-allocation, double free, unknown owner."""


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        # LIFO: a freed unnamed block is the next one handed out (it holds nothing worth
        # keeping), which also makes any early reuse show up at once in tests.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._refs = [0] * num_blocks
        self._reserved: dict[Hashable, int] = {}  # owner -> blocks reserved, not yet allocated
        self._num_reserved = 0
        self._hash_of: dict[int, bytes] = {}  # registered blocks -> their content hash
        self._by_hash: dict[bytes, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # hashed, refcount 0, LRU first

    # -- reading ------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks with no reference: the free list and the evictable cached blocks (reserved
        ones included)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        """Blocks with at least one reference."""
        return self.num_blocks - self.num_free

    @property
    def num_reserved(self) -> int:
        """Blocks promised to owners and not yet allocated."""
        return self._num_reserved

    @property
    def num_available(self) -> int:
        """Blocks a new reservation may take."""
        return self.num_free - self._num_reserved

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def refcount(self, block_id: int) -> int:
        return self._refs[block_id]

    @property
    def num_cached(self) -> int:
        """Blocks registered under a hash (referenced or evictable)."""
        return len(self._hash_of)

    def hash_of(self, block_id: int) -> bytes | None:
        return self._hash_of.get(block_id)

    def reserved_for(self, owner: Hashable) -> int:
        return self._reserved.get(owner, 0)

    # -- reservations -------------------------------------------------------------------------
    def can_reserve(self, n: int) -> bool:
        return 0 <= n <= self.num_available

    def reserve(self, owner: Hashable, n: int) -> None:
        if owner in self._reserved:
            raise BlockPoolError(f"owner {owner!r} already holds a reservation")
        if not self.can_reserve(n):
            raise BlockPoolError(f"cannot reserve {n} blocks: {self.num_available} available")
        self._reserved[owner] = n
        self._num_reserved += n

    def cancel_reservation(self, owner: Hashable) -> int:
        """Give back what `owner` reserved and did not allocate; returns that count."""
        n = self._reserved.pop(owner, 0)
        self._num_reserved -= n
        return n

    # -- blocks -------------------------------------------------------------------------------
    def allocate(self, owner: Hashable, n: int) -> tuple[int, ...]:
        """Take `n` blocks out of `owner`'s reservation; each starts with one (the owner's) ref."""
        left = self._reserved.get(owner)
        if left is None:
            raise BlockPoolError(f"owner {owner!r} has no reservation")
        if n > left:
            raise BlockPoolError(f"owner {owner!r} asks {n} blocks, {left} reserved")
        ids = tuple(self._pop_free() for _ in range(n))
        for b in ids:
            self._refs[b] = 1
        self._reserved[owner] = left - n
        self._num_reserved -= n
        return ids

    def take(self, owner: Hashable, n: int) -> tuple[int, ...]:
        """Allocate `n` free, unreserved blocks to `owner` (on-demand admission: no
        reservation, the scheduler preempts instead)."""
        if owner in self._reserved:
            raise BlockPoolError(f"owner {owner!r} holds a reservation: use allocate")
        if not 0 <= n <= self.num_available:
            raise BlockPoolError(f"cannot take {n} blocks: {self.num_available} available")
        self.reserve(owner, n)
        ids = self.allocate(owner, n)
        del self._reserved[owner]
        return ids

    def retain(self, block_ids: Iterable[int]) -> None:
        for b in block_ids:
            if self._refs[b] <= 0:
                raise BlockPoolError(f"retain of free block {b}")
            self._refs[b] += 1

    def release(self, block_ids: Iterable[int]) -> None:
        freed: list[int] = []
        kept: list[int] = []
        for b in block_ids:
            if self._refs[b] <= 0:
                raise BlockPoolError(f"release of free block {b}")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                (kept if b in self._hash_of else freed).append(b)
        # A table's tail goes first: its head is the prefix other requests are likelier to share.
        for b in reversed(kept):
            self._evictable[b] = None
        # Pushed in reverse, so the next request pops them in ascending order: consecutive blocks
        # let attention read a prefix in place instead of gathering it (ForwardBatch.build).
        self._free.extend(reversed(freed))

    def _pop_free(self) -> int:
        if self._free:
            return self._free.pop()
        b, _ = self._evictable.popitem(last=False)  # least recently released
        del self._by_hash[self._hash_of.pop(b)]
        return b

    # -- prefix cache -------------------------------------------------------------------------
    def lookup(self, block_hash: bytes) -> int | None:
        return self._by_hash.get(block_hash)

    def touch(self, block_id: int) -> None:
        """Take a reference on cached block `block_id` (a prefix hit)."""
        if block_id not in self._hash_of:
            raise BlockPoolError(f"touch of uncached block {block_id}")
        if self._refs[block_id] == 0:
            del self._evictable[block_id]
        self._refs[block_id] += 1

    def register(self, block_id: int, block_hash: bytes) -> bool:
        """Name referenced, fully written block `block_id` by its contents. False (nothing
        changes) if it is named already or another block holds that hash."""
        if self._refs[block_id] <= 0:
            raise BlockPoolError(f"register of free block {block_id}")
        if block_id in self._hash_of or block_hash in self._by_hash:
            return False
        self._hash_of[block_id] = block_hash
        self._by_hash[block_hash] = block_id
        return True

    def drop_cache(self) -> None:
        """Forget every hash (the stages' KV can no longer be trusted); evictable blocks go
        back to the free list."""
        self._free.extend(reversed(sorted(self._evictable)))
        self._evictable.clear()
        self._hash_of.clear()
        self._by_hash.clear()
