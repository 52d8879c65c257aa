"""The microbatch scheduler: chunked prefill + decode under a token budget
(docs/ARCHITECTURE.md#the-flow-of-one-request).

Driven by the coordinator: `add` requests, `schedule` plans (dispatch bookkeeping happens
there), `retire` them in dispatch order with the sampled tokens, `finish` requests.

With kv_admission="reserve" (the default), no preemption, by construction: a request is
admitted (strictly in order: by priority, then arrival; waiting.py) only once the pool can
reserve every block it can ever need, ceil((prompt + max_tokens) / block_size), so every
admitted request always finds its next block and the pipeline never deadlocks on memory; a
request that can never fit is refused by `add` (in both modes). kv_admission="on-demand"
admits on the prompt's blocks and preempts under pressure instead (admission.py).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable

from stages.protocol import MicrobatchPlan, NewRequest, Row

from .admission import ADMISSIONS
from .block_pool import BlockPool
from .config import SchedulerConfig
from .prefix_cache import BlockHashes, PrefixCacheStats
from .skip import ReqInfo, decide_send, needed_req_ids
from .state import (
    OutputLedger,
    OutputListener,
    ReqState,
    SchedRequest,
    SchedulerInvariantError,
    TokenEvent,
    check,
)
from .waiting import WaitingQueue


class _Inflight:
    __slots__ = ("plan", "blocks", "req_ids")

    def __init__(self, plan: MicrobatchPlan, blocks: list[int], req_ids: tuple[str, ...]):
        self.plan, self.blocks, self.req_ids = plan, blocks, req_ids


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        on_output_event: OutputListener | None = None,
        on_prefix_lookup: Callable[[int, int], None] | None = None,
    ) -> None:
        """on_prefix_lookup(queried, hit): tokens of an admitted prefix and how many of them
        were cached, called at each admission with prefix caching (the metrics' feed)."""
        self.config = config
        self.pool = BlockPool(config.num_blocks)
        self._waiting = WaitingQueue()  # by priority, then arrival
        self._running: dict[str, ReqState] = {}  # live admitted requests, admission order
        self._states: dict[str, ReqState] = {}  # admitted and not yet released (finished too)
        self._free_slots: deque[int] = deque(range(config.max_num_seqs))
        self._inflight: deque[_Inflight] = deque()
        self._finished_unannounced: list[str] = []
        self._ledger = OutputLedger(on_output_event)
        self._next_mb = 0
        self._resume: dict[str, tuple[int, ...]] = {}  # preempted, waiting: tokens generated
        self.admission = ADMISSIONS[config.kv_admission](config, self.pool)
        self.num_preemptions = 0
        self.prefix_stats = PrefixCacheStats()
        self._on_prefix_lookup = on_prefix_lookup

    # -- reading ------------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def waiting_prompt_tokens(self) -> int:
        """Prompt tokens of the requests not yet admitted: load the KV cache has yet to take."""
        return sum(r.prompt_len for r in self._waiting)

    @property
    def kv_usage(self) -> float:
        return self.pool.usage

    @property
    def inflight(self) -> int:
        return len(self._inflight)

    def inflight_mb_ids(self) -> tuple[int, ...]:
        return tuple(r.plan.mb_id for r in self._inflight)

    def pending_finished(self) -> tuple[str, ...]:
        """The req_ids the next plan lists in `finished` (finished or preempted since)."""
        return tuple(self._finished_unannounced)

    def comm_stats(self) -> dict[str, int]:
        """sent / skipped / missed / orphaned so far (state.OutputLedger)."""
        return dict(self._ledger.counts)

    def has_work(self) -> bool:
        return bool(self._waiting or self._running or self._inflight)

    def is_known(self, req_id: str) -> bool:
        return req_id in self._waiting or req_id in self._running

    # -- requests -----------------------------------------------------------------------------
    def add(self, req: SchedRequest) -> None:
        cfg = self.config
        if (
            req.req_id in self._waiting
            or req.req_id in self._states
            or req.req_id in self._finished_unannounced
        ):
            raise ValueError(f"request {req.req_id!r} is already known to the scheduler")
        if req.prompt_len < 1:
            raise ValueError(f"request {req.req_id!r}: empty prompt")
        if req.max_tokens < 1:
            raise ValueError(
                f"request {req.req_id!r}: max_tokens must be >= 1, got {req.max_tokens}"
            )
        total = req.prompt_len + req.max_tokens
        if total > cfg.max_model_len:
            raise ValueError(
                f"request {req.req_id!r}: prompt ({req.prompt_len} tokens) + "
                f"max_tokens ({req.max_tokens}) = {total} exceeds max_model_len "
                f"({cfg.max_model_len})"
            )
        need = cfg.blocks_for(total)
        if need > cfg.num_blocks:
            raise ValueError(
                f"request {req.req_id!r}: needs {need} KV blocks of "
                f"{cfg.block_size} tokens, the pool has {cfg.num_blocks}"
            )
        self._waiting.add(req)

    def finish(self, req_id: str, reason: str) -> bool:
        """End a request (stop, abort, length...). Its owner block refs and unused reservation
        go back now; its slot once no in-flight microbatch names it. The next plan lists it in
        `finished`. Returns False if the request is unknown or already finished."""
        if self._waiting.pop(req_id) is not None:
            self._resume.pop(req_id, None)  # a preempted incarnation was announced already
            return True  # never planned: the stages never heard of it
        st = self._running.pop(req_id, None)
        if st is None:
            return False
        st.finished, st.finish_reason = True, reason
        self.pool.release(st.blocks)
        self.pool.cancel_reservation(req_id)
        self._ledger.vanish(st.source_mb, req_id)
        st.source_mb = None
        self._finished_unannounced.append(req_id)
        if st.inflight == 0:
            self._release(st)
        return True

    def _release(self, st: ReqState) -> None:
        del self._states[st.req_id]
        self._free_slots.append(st.slot)

    # -- planning -----------------------------------------------------------------------------
    def schedule(self) -> MicrobatchPlan | None:
        """The next microbatch plan, already counted as dispatched; None when max_inflight
        plans are in flight or nothing can run now."""
        cfg = self.config
        if len(self._inflight) >= cfg.max_inflight:
            return None
        budget = cfg.max_num_batched_tokens
        rows: list[Row] = []
        named: list[ReqState] = []
        news: list[NewRequest] = []
        self.admission.begin_plan()
        for st in list(self._running.values()):  # decode rows first
            if budget == 0:
                break
            if self._decode_ready(st) and self._room(st, st.req.prompt_len + st.planned, named):
                rows.append(self._decode_row(st))
                named.append(st)
                budget -= 1
        for st in list(self._running.values()):  # then the next chunk of prompts under way
            if budget == 0:
                break
            if st.finished:
                continue  # preempted while this plan was built
            n = min(cfg.chunk_limit(st.prefill_pos), st.prefill_left, budget)
            if n > 0 and self._room(st, st.prefill_pos + n, named):
                rows.append(self._chunk_row(st, budget))
                named.append(st)
                budget -= rows[-1].num_tokens
        while budget > 0 and self._waiting and self._free_slots:  # then admit, in order
            admitted = self._admit_head(budget, named)
            if admitted is None:
                break  # strict order: nobody overtakes the head of the queue
            st, new = admitted
            news.append(new)
            rows.append(self._chunk_row(st, budget))
            named.append(st)
            budget -= rows[-1].num_tokens
        if not rows:
            return None
        return self._dispatch(rows, named, news)

    def _room(self, st: ReqState, end: int, named: list[ReqState]) -> bool:
        return self.admission.room(st, end, named, self._running, self._preempt)

    def _preempt(self, st: ReqState) -> None:
        """Finish `st` at the stages and queue it again, first, with what it generated."""
        rid = st.req_id
        outputs = tuple(st.output_ids)
        self.finish(rid, "preempted")
        self.num_preemptions += 1
        self._resume[rid] = outputs
        self._waiting.requeue(st.req)

    def _admit_head(self, budget: int, named: list[ReqState]) -> tuple[ReqState, NewRequest] | None:
        """Admit the head of the queue, or None if it does not fit yet (then nobody is)."""
        req = self._waiting.head()
        if req.req_id in self._states:
            return None  # its preempted incarnation is still in flight: FCFS, wait
        outputs = self._resume.get(req.req_id, ())
        prefix = req.prompt_token_ids + outputs
        hashes, hits = self._cached_prefix(prefix)
        if req.sampling.prompt_logprobs is not None:
            hits = []  # every prompt position is computed: its logprobs are asked for
        if not self.admission.admit(req, len(prefix), hits):
            return None
        self._waiting.pop(req.req_id)
        self._resume.pop(req.req_id, None)
        for b in hits:
            self.pool.touch(b)
        cached = len(hits) * self.config.block_size
        if hashes is not None:
            self.prefix_stats.queries += len(prefix)
            self.prefix_stats.hits += cached
            if self._on_prefix_lookup is not None:
                self._on_prefix_lookup(len(prefix), cached)
        st = ReqState(
            req,
            self._free_slots.popleft(),
            prefix=prefix,
            output_ids=list(outputs),
            generated=len(outputs),
            planned=len(outputs),
            prefill_pos=cached,
            blocks=list(hits),
            registered=len(hits),
            hashes=hashes,
        )
        self._running[req.req_id] = st
        self._states[req.req_id] = st
        # the first chunk fits in what admission checked; this books it in the plan
        first = min(self.config.chunk_limit(cached), st.prefill_left, budget)
        self._room(st, cached + first, named)
        # The last stage needs the prompt only for the repetition penalty, and the tokens
        # generated before a preemption only for the penalties' history (protocol.NewRequest).
        sampling = req.sampling
        wants_prompt = sampling.repetition_penalty != 1.0 or sampling.prompt_logprobs is not None
        prompt = req.prompt_token_ids if wants_prompt else ()
        history = outputs if sampling.needs_history else ()
        return st, NewRequest(req.req_id, st.slot, sampling, prompt, history)

    def _cached_prefix(self, prefix: tuple[int, ...]) -> tuple[BlockHashes | None, list[int]]:
        """The hashes of `prefix` and the cached blocks it starts with; the last token is never
        among them (prefill must compute at least one row to sample from)."""
        if not self.config.enable_prefix_caching:
            return None, []
        hashes = BlockHashes(self.config.block_size)
        hits = []
        for h in hashes.upto(prefix, (len(prefix) - 1) // self.config.block_size):
            b = self.pool.lookup(h)
            if b is None:
                break
            hits.append(b)
        return hashes, hits

    def _register_written(self, row: Row, st: ReqState) -> None:
        """Cache the blocks of `st` that retiring `row` has completed on every stage."""
        bs = self.config.block_size
        full = (row.start + row.num_tokens) // bs
        if st.hashes is None or full <= st.registered:
            return
        end = full * bs
        tokens = st.prefix
        if end > len(tokens):  # decode rows wrote generated tokens
            tokens = st.req.prompt_token_ids + tuple(st.output_ids)
        hashes = st.hashes.upto(tokens, full)
        for i in range(st.registered, len(hashes)):
            self.pool.register(st.blocks[i], hashes[i])
        st.registered = len(hashes)

    def _decode_ready(self, st: ReqState) -> bool:
        """Whether the next microbatch may carry a decode row of `st`. Without run-ahead: its
        previous token has retired (ReqState.decode_ready). With run-ahead: its previous
        sampling row is dispatched, fewer than max_tokens steps are planned (in flight ones
        included) and, while that row is in flight at mb m, this one is at mb >= m + S.

        Why S: stage 0 runs mb m + k right after m + k - 1; m's output comes back once m has
        crossed all S stages, i.e. about when stage 0 finishes m + S - 1. So k >= S never waits
        on it, k < S would stall stage 0 and drain the pipeline behind it. A per-request gap
        instead of S fixed groups: requests start decoding at any mb (their last prompt chunk)
        and keep its phase, so the requests sampled in mb m come back together in mb m + S (the
        round-robin group) without a slot-to-group table or waiting for a group's turn."""
        if not self.config.run_ahead:
            return st.decode_ready
        if st.finished or st.prefill_left > 0 or not 1 <= st.planned < st.req.max_tokens:
            return False
        if st.generated == st.planned:  # the previous sampling row has retired
            return True
        # With the host as the channel the plan carries the token: it must be back first; a
        # constrained request's mask needs it too.
        return (
            not self.config.tokens_from_host
            and not st.req.constrained
            and st.sample_mb is not None
            and self._next_mb - st.sample_mb >= self.config.num_stages
        )

    def _decode_row(self, st: ReqState) -> Row:
        # Without run-ahead nothing of the request is in flight here; with it, the previous
        # step may be.
        if st.sample_mb is None or st.source_mb != st.sample_mb:
            raise SchedulerInvariantError(
                f"{st.req_id!r}: decode input mb {st.sample_mb} is not the pending source "
                f"{st.source_mb}"
            )
        self._ledger.consume(st.sample_mb, st.req_id)
        st.source_mb = None
        token_ids: tuple[int, ...] | None = None
        input_from: int | None = st.sample_mb
        if self.config.tokens_from_host:
            check(
                st.generated == st.planned,
                f"{st.req_id!r}: a decode row from the host before its token {st.planned - 1}",
            )
            token_ids, input_from = (st.output_ids[st.planned - 1],), None
        return Row(
            st.req_id,
            st.slot,
            st.req.prompt_len + st.planned - 1,
            1,
            token_ids,
            input_from_mb=input_from,
            sample=True,
            output_index=st.planned,
            is_prefill=False,
        )

    def _chunk_row(self, st: ReqState, budget: int) -> Row:
        n = min(self.config.chunk_limit(st.prefill_pos), st.prefill_left, budget)
        start = st.prefill_pos
        st.prefill_pos += n
        last = st.prefill_left == 0
        return Row(
            st.req_id,
            st.slot,
            start,
            n,
            st.prefix[start : start + n],
            sample=last,
            output_index=st.generated,
            is_prefill=True,
        )

    def _dispatch(
        self, rows: list[Row], named: list[ReqState], news: list[NewRequest]
    ) -> MicrobatchPlan:
        mb_id = self._next_mb
        self._next_mb += 1
        updates = []
        retained: list[int] = []
        for row, st in zip(rows, named):
            have = len(st.blocks)
            want = self.config.blocks_for(row.start + row.num_tokens)
            if want > have:
                st.blocks.extend(self.admission.take(st.req_id, want - have))
            if len(st.blocks) > st.announced:  # cached prefix blocks are announced with new ones
                updates.append((st.req_id, tuple(st.blocks[st.announced :])))
                st.announced = len(st.blocks)
            retained.extend(st.blocks)
            st.inflight += 1
            if row.sample:
                st.planned += 1
                st.sample_mb = mb_id
        self.pool.retain(retained)
        info = {
            st.req_id: ReqInfo(len(st.prefix), st.req.max_tokens, st.req.wants_logprobs)
            for st in named
        }
        send = decide_send(self.config.skip_mode, rows, info)
        needed = needed_req_ids(rows, info)
        self._ledger.record(mb_id, send, needed)
        for rid in needed:
            self._states[rid].source_mb = mb_id
        plan = MicrobatchPlan(
            mb_id, tuple(rows), tuple(news), tuple(updates), tuple(self._finished_unannounced), send
        )
        self._finished_unannounced.clear()
        self._inflight.append(_Inflight(plan, retained, tuple(st.req_id for st in named)))
        return plan

    # -- retiring -----------------------------------------------------------------------------
    def abort_inflight(self, reason: str = "error") -> list[str]:
        """A stage failed: finish every live request an in-flight microbatch names, then retire
        those microbatches with no tokens. Returns the finished req_ids (dispatch order)."""
        victims = list(
            dict.fromkeys(
                rid for rec in self._inflight for rid in rec.req_ids if rid in self._running
            )
        )
        for rid in victims:
            self.finish(rid, reason)
        while self._inflight:
            self._retire(self._inflight[0].plan.mb_id, [], written=False)
        self.pool.drop_cache()  # what the failed stages wrote can no longer be trusted
        return victims

    def retire(self, mb_id: int, sampled: Iterable[tuple[str, int]]) -> list[TokenEvent]:
        """Retire the oldest in-flight microbatch with its sampled (req_id, token_id) pairs.
        Returns the accepted tokens; tokens of requests already finished are dropped."""
        return self._retire(mb_id, sampled, written=True)

    def _retire(
        self, mb_id: int, sampled: Iterable[tuple[str, int]], written: bool
    ) -> list[TokenEvent]:
        if not self._inflight:
            raise ValueError(f"retire({mb_id}): no microbatch in flight")
        rec = self._inflight[0]
        if rec.plan.mb_id != mb_id:
            raise ValueError(
                f"retire({mb_id}) out of order: the oldest in flight is "
                f"{rec.plan.mb_id}; retire in dispatch order"
            )
        samplers = {r.req_id: r for r in rec.plan.rows if r.sample}
        tokens: dict[str, int] = {}
        for req_id, tok in sampled:
            if req_id not in samplers:
                raise ValueError(f"retire({mb_id}): {req_id!r} sampled no token in this mb")
            if req_id in tokens:
                raise ValueError(f"retire({mb_id}): two tokens for {req_id!r}")
            tokens[req_id] = int(tok)
        for req_id in samplers:
            if req_id not in tokens and not self._states[req_id].finished:
                raise ValueError(f"retire({mb_id}): no token for live request {req_id!r}")
        self._inflight.popleft()
        events: list[TokenEvent] = []
        for row in rec.plan.rows:
            st = self._states[row.req_id]
            if written:
                self._register_written(row, st)
        self.pool.release(rec.blocks)  # after registering: the mb's refs keep them alive
        for row in rec.plan.rows:
            st = self._states[row.req_id]
            st.inflight -= 1
            if row.sample and not st.finished:
                check(
                    row.output_index == st.generated,
                    f"{row.req_id!r}: retiring output {row.output_index}, expected {st.generated}",
                )
                st.generated += 1
                st.output_ids.append(tokens[row.req_id])
                events.append(TokenEvent(row.req_id, tokens[row.req_id], row.output_index))
            if st.finished and st.inflight == 0:
                self._release(st)
        return events
