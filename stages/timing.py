"""Per-stage forward time without synchronising the device.

On CUDA a recv may be posted while we time, so we never call torch.cuda.synchronize: we record
events and read the elapsed time of the newest pair that has already completed.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch


@dataclass
class Measurement:
    start: object  # torch.cuda.Event, None on CPU
    end: object
    seconds: float | None = None  # known at stop on CPU, on first read on CUDA


class StageTimer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._open = None
        self._done: deque = deque(maxlen=64)
        self._last = 0.0
        self._mb = -1
        self._finished: list[tuple[int, float]] = []

    def start(self, mb_id: int) -> None:
        self._mb = mb_id
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._open = ev
        else:
            self._open = time.perf_counter()

    def stop(self) -> Measurement | None:
        """Close the open measurement; its handle tells when it completed and how long it took."""
        if self._open is None:
            return None
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._done.append((self._mb, self._open, end))
            handle = Measurement(self._open, end)
        else:
            self._last = time.perf_counter() - self._open
            self._finished.append((self._mb, self._last))
            handle = Measurement(None, None, self._last)
        self._open = None
        return handle

    @staticmethod
    def elapsed(handle: Measurement | None) -> float:
        """Seconds of one measurement, waiting for its own end event (not the device)."""
        if handle is None:
            return 0.0
        if handle.seconds is None:
            handle.end.synchronize()
            handle.seconds = handle.start.elapsed_time(handle.end) / 1000.0
        return handle.seconds

    def last_elapsed(self) -> float:
        """Seconds of the newest finished measurement (CPU: the one just stopped)."""
        self._drain()
        return self._last

    def take_finished(self) -> tuple[tuple[int, float], ...]:
        """(mb_id, seconds) of every measurement completed since the last call."""
        self._drain()
        out, self._finished = tuple(self._finished), []
        return out

    def flush(self) -> tuple[tuple[int, float], ...]:
        """Wait for this stage's own timing events (not the device) and return them all."""
        for _mb, _start, end in self._done:
            end.synchronize()
        return self.take_finished()

    def _drain(self) -> None:
        while self.cuda and self._done and self._done[0][2].query():
            mb, start, end = self._done.popleft()
            self._last = start.elapsed_time(end) / 1000.0
            self._finished.append((mb, self._last))
