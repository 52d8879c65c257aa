"""The copy output channel's two ring counters in shared host memory, and the hand-over that
leaves no name behind in /dev/shm.

Stage 0 creates the counters under a fresh /dev/shm name and publishes it; the last stage maps
that name and says so in the rendezvous store (also when it fails to: either way it is done
with the name); stage 0 then unlinks it. From there on the memory lives only in the two
mappings, so the kernel frees it when both processes are gone, however they end.
"""

from __future__ import annotations

import datetime
import mmap
import os
import uuid
from typing import Protocol

_SIZE = 16  # two int64
_PREFIX = "/dev/shm/ppserve-copy-"
_DONE_KEY = "ppserve/copy_channel/counters_mapped"


class KeyStore(Protocol):
    """What the hand-over needs of torch.distributed's TCPStore."""

    def set(self, key: str, value: str) -> None: ...

    def wait(self, keys: list[str], timeout: datetime.timedelta) -> None: ...


class SharedCounters:
    """OutputRing's counters (stages/output_ring.py) as two int64 both processes map."""

    def __init__(self, path: str, create: bool) -> None:
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, _SIZE)
            self._map = mmap.mmap(fd, _SIZE)
        finally:
            os.close(fd)
        self._bytes = memoryview(self._map)
        self._values = self._bytes.cast("q")
        self.path = path

    @classmethod
    def create(cls) -> SharedCounters:
        """Stage 0: new counters (zero) under a fresh name."""
        return cls(f"{_PREFIX}{uuid.uuid4().hex}", create=True)

    @staticmethod
    def done_with_name(store: KeyStore) -> None:
        """The last stage, once it has mapped the counters or failed to: stage 0 may unlink
        the name (and must not wait for a peer that gave up)."""
        store.set(_DONE_KEY, "1")

    def unlink_once_mapped(self, store: KeyStore, timeout_s: float) -> None:
        """Stage 0: wait until the last stage is done with the name, then unlink it (also on a
        timeout, which is raised)."""
        try:
            store.wait([_DONE_KEY], datetime.timedelta(seconds=timeout_s))
        finally:
            self.unlink()

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    @property
    def written(self) -> int:
        return int(self._values[0])

    @written.setter
    def written(self, value: int) -> None:
        self._values[0] = value

    @property
    def read(self) -> int:
        return int(self._values[1])

    @read.setter
    def read(self, value: int) -> None:
        self._values[1] = value

    def close(self) -> None:
        self._values.release()
        self._bytes.release()
        self._map.close()
