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
    start: torch.cuda.Event | None  # None on CPU
    end: torch.cuda.Event | None
    seconds: float | None = None  # known at stop on CPU, on first read on CUDA


class StageTimer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._open: torch.cuda.Event | float | None = None  # start event (CUDA) or time (CPU)
        self._done: deque[tuple[int, torch.cuda.Event, torch.cuda.Event]] = deque(maxlen=64)
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
        opened, self._open = self._open, None
        if opened is None:
            return None
        if isinstance(opened, float):
            self._last = time.perf_counter() - opened
            self._finished.append((self._mb, self._last))
            return Measurement(None, None, self._last)
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._done.append((self._mb, opened, end))
        return Measurement(opened, end)

    @staticmethod
    def elapsed(handle: Measurement | None) -> float:
        """Seconds of one measurement, waiting for its own end event (not the device)."""
        if handle is None:
            return 0.0
        if handle.seconds is None:
            if handle.start is None or handle.end is None:
                raise ValueError("a CUDA measurement without its events")
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
