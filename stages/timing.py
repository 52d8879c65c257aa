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

    def start(self, mb_id: int) -> None:
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
            self._done.append((self._open, end))
        else:
            self._last = time.perf_counter() - self._open
        self._open = None

    def last_elapsed(self) -> float:
        """Seconds of the newest finished measurement (CPU: the one just stopped)."""
        if self.cuda:
            while self._done and self._done[0][1].query():
                start, end = self._done.popleft()
                self._last = start.elapsed_time(end) / 1000.0
        return self._last
