"""Per-request scheduler state, the token events retire returns, and the output-channel ledger."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from stages.protocol import SamplingSpec

from .prefix_cache import BlockHashes


class SchedulerInvariantError(AssertionError):
    """An internal invariant of the scheduler broke (a bug, never bad input). Checked always,
    also under `python -O`: these are explicit checks, not `assert` statements."""


def check(condition: bool, message: str) -> None:
    if not condition:
        raise SchedulerInvariantError(message)


@dataclass(frozen=True)
class SchedRequest:
    """What the scheduler needs to know about a request (the coordinator owns the rest)."""

    req_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    sampling: SamplingSpec = field(default_factory=SamplingSpec)
    wants_logprobs: bool = False
    # Structured output: each step's token mask depends on the previous token, so the next
    # step waits for it (no run-ahead).
    constrained: bool = False
    priority: int = 0  # admission order among the waiting: lower first, then by arrival

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


class TokenEvent(NamedTuple):
    """A sampled token `retire` accepted: the request's `output_index`-th generated token."""

    req_id: str
    token_id: int
    output_index: int


@dataclass
class ReqState:
    """A request from admission until its slot and blocks are given back."""

    req: SchedRequest
    slot: int
    prefill_pos: int = 0  # prompt tokens planned so far (dispatched, maybe not yet retired)
    generated: int = 0  # tokens retired (accepted) so far
    inflight: int = 0  # dispatched, not yet retired microbatches naming this request
    blocks: list[int] = field(default_factory=list)  # block table, in order
    planned: int = 0  # sampling rows dispatched: tokens generated + sampled by mbs in flight
    sample_mb: int | None = None  # the microbatch of the latest dispatched sampling row
    source_mb: int | None = None  # dispatched mb sampling a needed token no decode read yet
    finished: bool = False
    finish_reason: str | None = None
    # What prefill computes: the prompt, or after a preemption the prompt + the tokens generated
    # before it (generated / planned then start at their count: output indices are absolute).
    prefix: tuple[int, ...] = ()
    output_ids: list[int] = field(default_factory=list)  # accepted tokens, in order
    announced: int = 0  # blocks of the table already sent to the stages
    registered: int = 0  # leading blocks of the table already cached (hit or registered)
    hashes: BlockHashes | None = None  # with prefix caching: its full blocks' content hashes

    def __post_init__(self) -> None:
        if not self.prefix:
            self.prefix = self.req.prompt_token_ids

    @property
    def req_id(self) -> str:
        return self.req.req_id

    @property
    def prefill_left(self) -> int:
        return len(self.prefix) - self.prefill_pos

    @property
    def decode_ready(self) -> bool:
        """A decode row may be planned: prompt done and retired, previous token retired, and
        the request continues (a request at max_tokens waits for the coordinator's finish)."""
        return (
            not self.finished
            and self.prefill_left == 0
            and self.inflight == 0
            and 1 <= self.generated < self.req.max_tokens
        )


@dataclass
class _Output:
    sent: bool
    pending: set[str]  # requests whose needed token this mb sampled, not yet consumed
    consumed: bool = False


OUTPUT_EVENTS = ("sent", "skipped", "missed", "orphaned")
# Called once per event as it happens, with the counts after it: the one feed of the metrics.
OutputListener = Callable[[str, Mapping[str, int]], None]


class OutputLedger:
    """Counts output-channel decisions and tracks who consumes each needed token.

    sent / skipped: decisions at dispatch. missed: a send that `auto` would have skipped.
    orphaned: a sent microbatch with needed tokens whose consumers all finished (stop, abort,
    preemption) before any decode row read one of them.
    """

    def __init__(self, listener: OutputListener | None = None) -> None:
        self.counts = dict.fromkeys(OUTPUT_EVENTS, 0)
        self._listener = listener
        self._outputs: dict[int, _Output] = {}

    def _event(self, name: str) -> None:
        self.counts[name] += 1
        if self._listener is not None:
            self._listener(name, self.counts)

    def record(self, mb_id: int, send: bool, needed: tuple[str, ...]) -> None:
        self._event("sent" if send else "skipped")
        if send and not needed:
            self._event("missed")
        if needed:
            self._outputs[mb_id] = _Output(send, set(needed))

    def consume(self, mb_id: int, req_id: str) -> None:
        """A decode row of `req_id` reads the token `mb_id` sampled for it."""
        out = self._outputs.get(mb_id)
        if out is None or req_id not in out.pending:
            raise SchedulerInvariantError(
                f"decode row of {req_id!r} reads mb {mb_id}, which sampled no needed token for it"
            )
        check(out.sent, f"decode row of {req_id!r} reads mb {mb_id}, whose output was skipped")
        out.pending.discard(req_id)
        out.consumed = True
        if not out.pending:
            del self._outputs[mb_id]

    def vanish(self, mb_id: int | None, req_id: str) -> None:
        """`req_id` finished; if its latest token was needed and unread, it never will be."""
        if mb_id is None:
            return
        out = self._outputs.get(mb_id)
        if out is None or req_id not in out.pending:
            return
        out.pending.discard(req_id)
        if not out.pending:
            del self._outputs[mb_id]
            if out.sent and not out.consumed:
                self._event("orphaned")
