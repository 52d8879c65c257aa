"""Kernel fallbacks: how a backend says it cannot serve an input (docs/ARCHITECTURE.md,
Kernel backends).

Nothing falls back silently. A backend can refuse at two moments:

- when the stage is built: its module may define ``supports(op, target) -> Refusal | None``,
  asked by the registry (stages/kernels/registry.py) with the shapes the model's family
  declares for each op (``Family.op_shapes``), its dtype and its KV block size. Under "auto"
  a refused backend is skipped (the op takes the next one, in the end the torch reference);
  a backend named explicitly is an error then and there.
- inside a call: a non-torch backend handed an input it cannot take (a dtype, width or head
  count the stage's shapes did not foresee, a chunk too short to be worth its launch) routes
  it to another implementation, and says so first with ``record_fallback``.

Both go through ``FALLBACKS``, the one process-local registry of this module: the first time
an (op, backend, reason) occurs it is logged (a warning, or info for a route taken by design,
e.g. cuDNN leaving short chunks to SDPA); every time it is counted. Each stage's StepResult
carries what its process counted since its previous result (``take_new``), and the coordinator
adds it to ``ppserve_kernel_fallbacks_total{op,backend,reason}`` (app/metrics.py). ``reason`` is
one of the short, fixed categories of ``REASONS`` (a metric label: bounded); the specifics
(shapes, dtypes) go to the log line only.

What is not counted, or counted differently:
- a call captured in a CUDA graph runs its Python once, at capture: a fallback inside a
  captured step is counted once per capture, not per replay (a family captures only under
  backends that take its decode step: Family.paged_decode_graphs). A stage on CUDA whose
  attention backend cannot capture its decode step says so once, when its cache is allocated
  (AttentionBackend.announce_eager, stages/attention/base.py): counted under the op that
  refuses;
- an input with no rows does no work on either path and is not counted;
- the KV-cache writers and the FP8 activation quantizer (triton_fp8_latent, triton_fp8_act)
  are every device's path, not a chosen backend: their torch branch on CPU is no fallback,
  on CUDA without triton it is (``no_triton``).

Standard library only: the family table (stages/models/families.py) declares OpShapes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field

from stages.protocol import FallbackCount

log = logging.getLogger(__name__)

# reason -> (what it means, whether it is a route taken by design: logged at info, not warning)
REASONS: dict[str, tuple[str, bool]] = {
    "dtype": ("a dtype the kernel does not take", False),
    "head_dim": ("a head or latent width the kernel does not take", False),
    "heads": ("a number of heads the kernel does not take", False),
    "page_size": ("a KV page (block) size the kernel does not take", False),
    "shape": ("another shape or layout the kernel does not take (alignment, tile grid)", False),
    "device": ("an input not on the device the kernel runs on", False),
    "no_triton": ("triton is not installed", False),
    "no_plan": ("the batch state the kernel reads was not built for this call", False),
    "few_rows": ("fewer rows than the kernel is worth launching for (by design)", True),
    "eager": ("a kernel a CUDA graph cannot capture: decode steps run eager", False),
}


@dataclass(frozen=True)
class OpShape:
    """What one op's calls look like for a model (declared by its family): query heads, the
    query/key width (MLA: latent + rope) and the output width per head (0: no such width)."""

    heads: int
    head_dim: int
    v_dim: int = 0


@dataclass(frozen=True)
class KernelTarget:
    """What a stage asks of its kernels: the ops its layers call (op -> OpShape; an op not
    listed is never called, so no backend is refused for it), the model's dtype (a torch dtype
    name, "bfloat16") and the KV cache's block size."""

    shapes: Mapping[str, OpShape] = field(default_factory=dict)
    dtype: str = "bfloat16"
    block_size: int = 64


@dataclass(frozen=True)
class Refusal:
    """Why a backend cannot serve a target: a REASONS category and the specifics."""

    reason: str
    detail: str

    def __post_init__(self) -> None:
        if self.reason not in REASONS:
            raise ValueError(f"unknown fallback reason {self.reason!r}; one of {sorted(REASONS)}")


Key = tuple[str, str, str]  # (op, backend, reason)


class FallbackLog:
    """Counts of fallbacks by (op, backend, reason) in this process, each logged once.

    One instance, FALLBACKS, serves the process (a stage actor); ``reset`` clears it (tests).
    ``take_new`` has one reader: the stage runner, which puts the counts into its StepResults.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[Key, int] = {}
        self._taken: dict[Key, int] = {}

    def record(self, op: str, backend: str, reason: str, detail: str = "") -> None:
        key = (op, backend, reason)
        with self._lock:
            n = self._counts.get(key)
            if n is None and reason not in REASONS:
                raise ValueError(f"unknown fallback reason {reason!r}; one of {sorted(REASONS)}")
            self._counts[key] = (n or 0) + 1
        if n is None:
            meaning, planned = REASONS[reason]
            log.log(
                logging.INFO if planned else logging.WARNING,
                "kernel fallback: %s on %s (%s: %s)%s",
                op,
                backend,
                reason,
                meaning,
                f": {detail}" if detail else "",
            )

    def counts(self) -> dict[Key, int]:
        """Every count since the process started (or the last reset)."""
        with self._lock:
            return dict(self._counts)

    def take_new(self) -> tuple[FallbackCount, ...]:
        """What was counted since the previous call."""
        with self._lock:
            new = tuple(
                FallbackCount(op, backend, reason, n - self._taken.get((op, backend, reason), 0))
                for (op, backend, reason), n in self._counts.items()
                if n != self._taken.get((op, backend, reason), 0)
            )
            self._taken = dict(self._counts)
        return new

    def reset(self) -> None:
        """Forget every count (and which keys were logged)."""
        with self._lock:
            self._counts.clear()
            self._taken.clear()


FALLBACKS = FallbackLog()


def record_fallback(op: str, backend: str, reason: str, detail: str = "") -> None:
    """A backend routed a call of `op` to another implementation: counted, logged the first
    time for this (op, backend, reason)."""
    FALLBACKS.record(op, backend, reason, detail)
