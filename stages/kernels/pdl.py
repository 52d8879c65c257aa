"""Programmatic dependent launch (PDL, Hopper and later) for the Triton kernels.

A kernel launched with PDL may be started while the kernel before it in the stream is still
running: its blocks are placed and set up, then each waits at the kernel's first statement
(``enter``: ``griddepcontrol.wait``) until that kernel has finished and its writes are visible,
and lets the next kernel start the same way (``griddepcontrol.launch_dependents``). A decode
step of one row is some 400 small kernels (docs/PERFORMANCE.md), each of which otherwise starts
only after the one before has drained.

The rule: a kernel launched with ``options(...)`` calls ``enter(PDL)`` before it touches memory,
in every program. Before its wait it could read what the kernel before has not yet written, or
overwrite what that kernel still reads; and a kernel that never waited would let the one after
it start before the kernel before it had finished. Kernels launched without it (cuBLAS,
FlashMLA, torch's) keep the stream's order; CUDA graphs capture the launches with their
programmatic edges.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

# off: every launch a plain one (the one-row V4 decode step 4-5 % slower, docs/PERFORMANCE.md)
ENABLED = True


@functools.lru_cache(maxsize=None)
def _supported(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def options(t: torch.Tensor) -> dict[str, Any]:
    """A launch's keywords for a kernel over t's device: PDL (the kernel's constexpr) and
    Triton's launch_pdl on CUDA sm_90+ while ENABLED; PDL=False elsewhere (Triton's interpreter
    runs no griddepcontrol)."""
    on = ENABLED and t.is_cuda and _supported(t.device.index or 0)
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - depends on the install
    triton = None

if triton is not None:

    @triton.jit  # type: ignore[untyped-decorator]
    def enter(PDL: tl.constexpr):  # type: ignore[no-untyped-def]
        """A PDL kernel's first statement: wait for the kernel before, then let the next one
        start (its blocks wait in their own enter)."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
