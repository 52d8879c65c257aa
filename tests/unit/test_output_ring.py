"""The copy channel's ordering protocol (stages/output_ring.py), driven as two hosts would:
a slot is never written again before its previous message's use is queued, a wait is never
queued before its message is recorded, and both ends agree on every message's slot. Then the
counters' hand-over in shared memory, which leaves no name in /dev/shm."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import pytest

from stages.output_ring import LocalCounters, OutputRing, RingOrderError
from stages.shared_counters import SharedCounters


def _pair(slots):
    counters = LocalCounters()
    return OutputRing(slots, counters), OutputRing(slots, counters)


def test_slots_cycle_and_a_full_ring_blocks_the_producer():
    producer, consumer = _pair(3)
    assert [producer.written() for _ in range(3)] == [(0, 0), (1, 1), (2, 2)]
    assert not producer.writable()  # message 0 is not read yet: slot 0 is busy
    with pytest.raises(RingOrderError):
        producer.written()
    seqs = [consumer.expect() for _ in range(4)]
    assert seqs == [0, 1, 2, 3]
    assert consumer.read(0) == 0
    assert producer.writable() and producer.written() == (3, 0)
    assert not consumer.readable(4)


def test_reads_are_in_order_and_only_after_the_record():
    producer, consumer = _pair(4)
    a, b = consumer.expect(), consumer.expect()
    assert not consumer.readable(a)
    with pytest.raises(RingOrderError, match="before the producer"):
        consumer.read(a)
    producer.written()
    producer.written()
    with pytest.raises(RingOrderError, match="out of order"):
        consumer.read(b)
    assert consumer.read(a) == 0 and consumer.read(b) == 1


def test_random_interleavings_never_overwrite_an_unread_slot():
    """Two hosts at random speeds; a model of the slots' contents checks each read."""
    rng = random.Random(0)
    for slots in (1, 2, 5):
        producer, consumer = _pair(slots)
        contents: dict[int, int] = {}  # slot -> seq written there last
        expected: list[int] = []
        total, written = 200, 0
        while written < total or expected:
            if written < total and rng.random() < 0.5:
                if rng.random() < 0.7:  # the coordinator dispatched one more sending plan
                    expected.append(consumer.expect())
                if producer.writable() and producer.next_write < len(expected):
                    seq, slot = producer.written()
                    assert slot not in contents or contents[slot] < seq - slots + 1
                    contents[slot] = seq
                    written += 1
                continue
            if expected and consumer.readable(expected[0]):
                seq = expected.pop(0)
                slot = consumer.read(seq)
                assert contents[slot] == seq  # nobody overwrote it before this read
            elif written >= total:
                break
        assert consumer.next_read == producer.next_write


# -- the counters in shared memory (stages/shared_counters.py) ---------------------------------
def _store():
    from torch.distributed import TCPStore

    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    return master, TCPStore("127.0.0.1", master.port, is_master=False)


def _leftovers():
    return sorted(p.name for p in Path("/dev/shm").glob("ppserve-copy-*"))


def test_shared_counters_leave_no_name_once_the_peer_mapped_them():
    """Stage 0 (a thread here) hands the counters over and unlinks their name; the two
    mappings still share the counters, so a crash of either end leaves nothing behind."""
    before = _leftovers()
    stage0_store, last_store = _store()
    owner = SharedCounters.create()
    name = Path(owner.path).name
    handover = threading.Thread(target=owner.unlink_once_mapped, args=(stage0_store, 30.0))
    handover.start()
    try:
        peer = SharedCounters(owner.path, create=False)
    finally:
        SharedCounters.done_with_name(last_store)
    handover.join(30)
    assert not handover.is_alive()
    assert name not in _leftovers() and _leftovers() == before
    producer, consumer = OutputRing(2, peer), OutputRing(2, owner)
    assert producer.written() == (0, 0)
    seq = consumer.expect()
    assert consumer.readable(seq) and consumer.read(seq) == 0
    assert owner.written == peer.written == 1 and owner.read == peer.read == 1
    peer.close()
    owner.close()


def test_a_peer_that_fails_to_map_still_releases_the_name():
    stage0_store, last_store = _store()
    owner = SharedCounters.create()
    try:
        SharedCounters(owner.path + "-not-there", create=False)
    except FileNotFoundError:
        pass
    finally:
        SharedCounters.done_with_name(last_store)
    owner.unlink_once_mapped(stage0_store, 30.0)  # returns at once: the peer is done
    assert not Path(owner.path).exists()
    owner.close()


def test_a_peer_that_never_answers_times_out_and_the_name_goes():
    stage0_store, _ = _store()
    owner = SharedCounters.create()
    with pytest.raises(Exception, match="(?i)timeout|timed out"):
        owner.unlink_once_mapped(stage0_store, 0.2)
    assert not Path(owner.path).exists()
    owner.close()
