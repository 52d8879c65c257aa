"""The ordering protocol of the copy output channel (stages/copy_channel.py): pure Python.

The last stage writes each output message into one slot of a ring that lives on stage 0's GPU
and records that slot's "ready" event; stage 0 waits on it before its consumer and records the
slot's "consumed" event after. A CUDA event is re-recorded in place and a wait binds to the
latest record at the time it is queued, so both hosts keep to an order that the two counters
in shared host memory publish:

- a message's slot is `seq % num_slots`, seq counting messages in plan order on both ends;
- the producer writes message `seq` only once the consumer has queued its use of `seq -
  num_slots` (read > seq - num_slots): the consumer's "consumed" record for that slot then
  exists, and the producer's stream waits on it before overwriting the slot;
- the consumer queues its wait for message `seq` only once the producer has recorded it
  (written > seq): otherwise it would bind to the slot's previous message.
"""

from __future__ import annotations

from typing import Protocol


class RingCounters(Protocol):
    """Two monotonic message counts shared by both ends (one writer each)."""

    written: int  # messages whose ready event the producer has recorded
    read: int  # messages whose use the consumer has queued (and recorded as consumed)


class LocalCounters:
    """RingCounters in one process (tests; the channel maps them into shared memory)."""

    def __init__(self) -> None:
        self.written = 0
        self.read = 0


class RingOrderError(RuntimeError):
    """A side used the ring out of the protocol's order (a bug, or channels out of step)."""


class OutputRing:
    """One end's view of the ring: the producer calls `writable`/`written`, the consumer
    `expect`/`readable`/`read`, each in message order."""

    def __init__(self, num_slots: int, counters: RingCounters) -> None:
        if num_slots < 1:
            raise ValueError(f"an output ring needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self.counters = counters
        self.next_write = 0  # producer: the next message's seq
        self.next_expected = 0  # consumer: the seq the next expected message gets
        self.next_read = 0  # consumer: the oldest expected message not yet read

    def slot(self, seq: int) -> int:
        return seq % self.num_slots

    # -- producer --------------------------------------------------------------------------
    def writable(self) -> bool:
        """Whether the next message's slot is free: its previous message's use is queued."""
        return self.counters.read > self.next_write - self.num_slots

    def written(self) -> tuple[int, int]:
        """The next message's (seq, slot) is written and its ready event recorded: publish
        it. Only after `writable()`."""
        if not self.writable():
            raise RingOrderError(
                f"message {self.next_write} written to slot {self.slot(self.next_write)} "
                f"before message {self.next_write - self.num_slots} there was read"
            )
        seq = self.next_write
        self.next_write += 1
        self.counters.written = self.next_write
        return seq, self.slot(seq)

    # -- consumer --------------------------------------------------------------------------
    def expect(self) -> int:
        """A plan sends one message: the seq it will carry (plan order)."""
        seq = self.next_expected
        self.next_expected += 1
        return seq

    def readable(self, seq: int) -> bool:
        """Whether the producer has recorded message `seq` (its wait may be queued)."""
        return self.counters.written > seq

    def read(self, seq: int) -> int:
        """The use of message `seq` (its wait, the consumer, the consumed record) is queued:
        its slot may be written again. In order; returns the slot."""
        if seq != self.next_read:
            raise RingOrderError(f"message {seq} read out of order: {self.next_read} is next")
        if not self.readable(seq):
            raise RingOrderError(f"message {seq} read before the producer recorded it")
        self.next_read += 1
        self.counters.read = self.next_read
        return self.slot(seq)
