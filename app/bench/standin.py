"""The one-GPU stand-in for a pending NCCL recv (docs/ARCHITECTURE.md, "why the output
channel matters"): one CTA spinning on a side stream (`torch.cuda._sleep`) holds an SM as a
waiting recv kernel does, so a kernel's contention can be measured where NCCL cannot pair two
ranks. It matches the real recv for persistent kernels at full occupancy and is harsher
elsewhere: tables made with it say so.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch

# SM clock cycles per millisecond the spin is sized by (H200 boost clock, 1.98 GHz); a lower
# clock only makes the spin last longer
CYCLES_PER_MS = 1.98e6
SPIN_KERNEL = "spin_kernel"  # torch.cuda._sleep's kernel, left out of kernel tables


class PendingRecvStandin:
    """Posts the spin on its own stream; `post(ms)` returns an event recorded when it ends, so a
    measurement can check that the spin outlasted what it timed."""

    def __init__(self) -> None:
        self.side = torch.cuda.Stream()

    def post(self, ms: float) -> torch.cuda.Event:
        done = torch.cuda.Event()
        with torch.cuda.stream(self.side):
            torch.cuda._sleep(int(ms * CYCLES_PER_MS))
            done.record()
        return done


def median_ms(
    fn: Callable[[], object],
    pre: Callable[[], torch.cuda.Event] | None = None,
    reps: int = 15,
    inner: int = 1,
) -> dict[str, Any]:
    """Median ms per call of `inner` back-to-back calls, over `reps` CUDA-event timings after 3
    warm-ups. `pre` leaves a wait pending on another stream just before each timing (the
    stand-in's spin, a copy channel's wait) and returns the event it ends with; the result
    then counts the timings it outlasted (`covered`: the others were not contended
    throughout)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times: list[float] = []
    covered = 0
    for _ in range(reps):
        pending = pre() if pre is not None else None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        if pending is not None:
            covered += not pending.query()
        times.append(start.elapsed_time(end) / inner)
        torch.cuda.synchronize()
    row: dict[str, Any] = {"ms": round(statistics.median(times), 4)}
    if pre is not None:
        row["covered"] = f"{covered}/{reps}"
    return row


def alone_and_contended(
    fn: Callable[[], object], standin: PendingRecvStandin, reps: int = 15, inner: int = 1
) -> dict[str, Any]:
    """fn alone, then under the spin (sized to 2x the alone time + 20 ms): both medians, the
    ratio, and how many contended timings the spin covered."""
    alone = median_ms(fn, reps=reps, inner=inner)
    spin_ms = 2 * alone["ms"] * inner + 20
    busy = median_ms(fn, lambda: standin.post(spin_ms), reps, inner)
    return {
        "alone_ms": alone["ms"],
        "standin_ms": busy["ms"],
        "standin_x": round(busy["ms"] / alone["ms"], 3),
        "standin_covered": busy["covered"],
    }
