import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.scheduler.block_pool import BlockPool, BlockPoolError


def test_reserve_allocate_release_roundtrip():
    pool = BlockPool(4)
    assert pool.can_reserve(4) and not pool.can_reserve(5)
    pool.reserve("a", 3)
    assert pool.num_available == 1 and pool.num_used == 0 and pool.usage == 0.0
    ids = pool.allocate("a", 2)
    assert len(set(ids)) == 2 and pool.num_used == 2 and pool.usage == 0.5
    assert pool.reserved_for("a") == 1 and pool.num_available == 1
    with pytest.raises(BlockPoolError):
        pool.allocate("a", 2)  # only 1 left in the reservation
    assert pool.cancel_reservation("a") == 1
    pool.release(ids)
    assert pool.num_free == 4 and pool.num_used == 0 and pool.num_reserved == 0


def test_block_returns_only_at_refcount_zero():
    pool = BlockPool(2)
    pool.reserve("a", 2)
    (b,) = pool.allocate("a", 1)
    pool.retain([b])  # an in-flight microbatch names it
    pool.release([b])  # the owner finishes
    pool.cancel_reservation("a")
    assert pool.refcount(b) == 1 and pool.num_free == 1
    pool.reserve("b", 1)
    (c,) = pool.allocate("b", 1)
    assert c != b  # never handed to another request while in flight
    pool.release([b])  # the microbatch retires
    assert pool.refcount(b) == 0 and pool.num_free == 1


def test_misuse_raises():
    pool = BlockPool(2)
    with pytest.raises(BlockPoolError):
        pool.allocate("nobody", 1)
    pool.reserve("a", 1)
    with pytest.raises(BlockPoolError):
        pool.reserve("a", 1)
    with pytest.raises(BlockPoolError):
        pool.reserve("b", 2)
    (b,) = pool.allocate("a", 1)
    pool.release([b])
    with pytest.raises(BlockPoolError):
        pool.release([b])
    with pytest.raises(BlockPoolError):
        pool.retain([b])
    with pytest.raises(ValueError):
        BlockPool(0)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 16), st.lists(st.tuples(st.integers(0, 3), st.integers(0, 5)), max_size=60))
def test_random_ops_conserve_blocks(n, ops):
    pool = BlockPool(n)
    owners: dict[int, list[int]] = {}
    held: list[int] = []  # extra references, like in-flight microbatches
    for op, k in ops:
        if op == 0 and k not in owners and pool.can_reserve(k):
            pool.reserve(k, k)
            owners[k] = []
        elif op == 1 and owners:
            o = sorted(owners)[k % len(owners)]
            if pool.reserved_for(o):
                owners[o].extend(pool.allocate(o, 1))
                pool.retain(owners[o][-1:])
                held.append(owners[o][-1])
        elif op == 2 and owners:
            o = sorted(owners)[k % len(owners)]
            pool.release(owners.pop(o))
            pool.cancel_reservation(o)
        elif op == 3 and held:
            pool.release([held.pop(0)])
        live = [b for bs in owners.values() for b in bs]
        assert len(live) == len(set(live))
        assert pool.num_free >= pool.num_reserved
        assert pool.num_used == len(set(live) | set(held))
    for o in list(owners):
        pool.release(owners.pop(o))
        pool.cancel_reservation(o)
    pool.release(held)
    assert pool.num_free == n and pool.num_reserved == 0
