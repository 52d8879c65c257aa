"""The block pool with prefix caching (docs/ARCHITECTURE.md#kv-cache): random admissions of requests
whose token sequences share prefixes, against a model of who holds which block."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.scheduler.block_pool import BlockPool, BlockPoolError
from app.scheduler.prefix_cache import BlockHashes, block_hash

BS = 2


def check_pool(pool: BlockPool, holders: dict[str, list[int]], written: dict[int, bytes]):
    """Exact accounting and the cache's invariants against the model."""
    refs = [0] * pool.num_blocks
    for blocks in holders.values():
        for b in blocks:
            refs[b] += 1
    assert [pool.refcount(b) for b in range(pool.num_blocks)] == refs, "refcounts"
    free = set(pool._free)
    evictable = set(pool._evictable)
    assert len(free) == len(pool._free) and not free & evictable
    assert free | evictable == {b for b in range(pool.num_blocks) if refs[b] == 0}
    assert pool.num_free == len(free) + len(evictable)
    assert pool.num_used == pool.num_blocks - pool.num_free == sum(r > 0 for r in refs)
    assert all(pool.hash_of(b) is None for b in free)
    assert all(pool.hash_of(b) is not None for b in evictable)
    hashes = [pool.hash_of(b) for b in range(pool.num_blocks) if pool.hash_of(b) is not None]
    assert len(hashes) == len(set(hashes)) == pool.num_cached, "two blocks with one hash"
    for b in range(pool.num_blocks):
        h = pool.hash_of(b)
        if h is not None:
            assert pool.lookup(h) == b and written[b] == h, "a block named for other contents"


ops = st.lists(
    st.tuples(st.sampled_from(["admit", "write", "finish"]), st.integers(0, 5),
              st.integers(0, 3), st.integers(1, 6)),
    max_size=60)


@settings(max_examples=300, deadline=None)
@given(num_blocks=st.integers(1, 12), ops=ops)
def test_random_sharing_keeps_the_books_exact(num_blocks, ops):
    pool = BlockPool(num_blocks)
    holders: dict[str, list[int]] = {}  # owner -> its block table
    seqs: dict[str, tuple[int, ...]] = {}
    written: dict[int, bytes] = {}  # block -> hash of the chain its KV holds
    hits = queries = 0
    for op, owner_n, family, length in ops:
        owner = f"o{owner_n}"
        if op == "admit" and owner not in holders:
            # families 1..3 share their first block; a family shares its whole head
            seq = tuple([7] * BS * min(family, 1) + [family] * BS * length)[: BS * length]
            hashes = BlockHashes(BS).upto(seq, len(seq) // BS)
            table = []
            for h in hashes:
                b = pool.lookup(h)
                if b is None:
                    break
                table.append(b)
            revived = sum(pool.refcount(b) == 0 for b in table)
            fresh = len(hashes) - len(table)
            if fresh + revived > pool.num_available:
                continue
            for b in table:
                pool.touch(b)
            new = pool.take(owner, fresh)
            for b in new:
                written.pop(b, None)  # handed out again: its old contents are gone
            for b in table:
                assert written[b] == pool.hash_of(b)
            queries += len(seq)
            hits += len(table) * BS
            holders[owner], seqs[owner] = table + list(new), seq
        elif op == "write" and owner in holders:  # its KV is written: name its blocks
            for b, h in zip(holders[owner], BlockHashes(BS).upto(seqs[owner], 99)):
                if b not in written:
                    written[b] = h
                    registered = pool.register(b, h)
                    assert registered == (pool.hash_of(b) == h)
        elif op == "finish" and owner in holders:
            pool.release(holders.pop(owner))
        check_pool(pool, holders, written)
    for blocks in holders.values():
        pool.release(blocks)
    holders.clear()
    check_pool(pool, holders, written)
    assert pool.num_free == num_blocks and hits <= queries


def test_cached_blocks_are_kept_until_the_pool_needs_them_least_recent_first():
    pool = BlockPool(3)
    a = pool.take("a", 2)
    h0 = block_hash(None, (1, 2))
    h1 = block_hash(h0, (3, 4))
    assert pool.register(a[0], h0) and pool.register(a[1], h1)
    pool.release(a)
    assert pool.num_free == 3 and pool.num_used == 0 and pool.num_cached == 2
    assert pool.lookup(h0) == a[0]
    (c,) = pool.take("c", 1)  # the unhashed free block goes first
    assert c not in a and pool.num_cached == 2
    (d,) = pool.take("d", 1)  # then the least recently released: a table's tail first
    assert d == a[1] and pool.lookup(h1) is None and pool.lookup(h0) == a[0]
    pool.touch(a[0])  # a hit revives it: no longer evictable
    assert pool.refcount(a[0]) == 1 and pool.num_free == 0
    with pytest.raises(BlockPoolError):
        pool.take("e", 1)


def test_register_refuses_free_blocks_and_second_names():
    pool = BlockPool(2)
    a, b = pool.take("a", 2)
    h = block_hash(None, (5,))
    assert pool.register(a, h)
    assert not pool.register(b, h), "one hash names one block"
    assert not pool.register(a, block_hash(None, (6,))), "a block keeps its first name"
    pool.release([b])
    with pytest.raises(BlockPoolError):
        pool.register(b, block_hash(None, (7,)))
    with pytest.raises(BlockPoolError):
        pool.touch(b)
    pool.drop_cache()
    assert pool.lookup(h) is None and pool.num_cached == 0
    pool.release([a])
    assert pool.num_free == 2


def test_hash_chains_name_the_whole_prefix():
    h = BlockHashes(2)
    assert h.upto((1, 2, 3, 4, 5), 9) == h.hashes and len(h.hashes) == 2
    other = BlockHashes(2).upto((9, 9, 3, 4), 2)
    assert other[1] != h.hashes[1], "same block tokens after another prefix: another name"
    assert BlockHashes(2).upto((1, 2, 3, 4), 2) == h.hashes
