"""Per-stage forward time without synchronising the device.

On CUDA a recv may be posted while we time, so we never call torch.cuda.synchronize: we record
events and read the elapsed time of the newest pair that has already completed.
"""

from __future__ import annotations

import time
from collections import deque

import torch


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

    def stop(self) -> None:
        if self._open is None:
            return
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._done.append((self._mb, self._open, end))
        else:
            self._last = time.perf_counter() - self._open
            self._finished.append((self._mb, self._last))
        self._open = None

    def wait_last(self) -> None:
        """Block the host on this stage's own last event (not the device): the last stage
        retires a microbatch only once its work is done."""
        if self.cuda and self._done:
            self._done[-1][2].synchronize()

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
