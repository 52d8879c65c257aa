"""One request's text side on the coordinator: tokens in, detokenized deltas out, stop checks."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from app.request import RequestOutput, SamplingParams, TokenLogprob, merge_outputs
from app.tokenizer import IncrementalDetokenizer, StopStringMatcher, Tokenizer

if TYPE_CHECKING:
    from app.metrics import EngineMetrics
    from app.structured import GrammarMatcher
    from stages.protocol import PromptLogprobs, SampledToken


class RequestStream:
    def __init__(
        self,
        req_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        max_tokens: int,
        tokenizer: Tokenizer,
        eos_token_ids: tuple[int, ...],
        arrival_time: float,
        grammar: GrammarMatcher | None = None,
        stream_interval: int = 1,
    ):
        self.req_id = req_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.max_tokens = max_tokens
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.arrival_time = arrival_time
        self.scheduled_time: float | None = None
        self.queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.output_ids: list[int] = []
        self.finished = False
        self._detok = IncrementalDetokenizer(tokenizer, params.skip_special_tokens)
        self._stops = StopStringMatcher(params.stop, params.include_stop_str_in_output)
        self._last_token_time: float | None = None
        self._held: tuple[list[int], str, list[TokenLogprob]] = ([], "", [])
        self._sent_prompt = False
        self.grammar = grammar  # structured output: app.structured.GrammarMatcher
        self.stream_interval = stream_interval  # tokens a delta carries after the first
        self.error: str | None = None  # why it finished with "error"
        self._prompt_lps: dict[int, TokenLogprob] = {}  # prompt position -> its logprob

    def _stop_reason(self, token_id: int) -> str | None:
        if token_id in self.params.stop_token_ids:
            return "stop"
        if not self.params.ignore_eos and token_id in self.eos_token_ids:
            return "stop"
        return None

    def append(
        self, token_id: int, sampled: SampledToken, metrics: EngineMetrics | None = None
    ) -> str | None:
        """Take one sampled token. Returns a finish reason, or None to carry on."""
        now = time.time()
        if metrics:
            if self._last_token_time is None:
                metrics.observe_ttft(now - self.arrival_time)
            else:
                metrics.observe_itl(now - self._last_token_time)
            metrics.add_tokens(generation=1)
        self._last_token_time = now
        self.output_ids.append(token_id)
        lp = None
        if self.params.logprobs is not None and sampled.logprob is not None:
            lp = TokenLogprob(token_id, sampled.logprob, list(sampled.top_logprobs))
        reason = self._stop_reason(token_id)
        if reason is None and self.grammar is not None:
            self.error = self.grammar.accept(token_id)
            reason = "error" if self.error else None
        text = ""
        if reason is None:
            text, stopped = self._stops.feed(self._detok.add([token_id]))
            if stopped or (self.grammar is not None and self.grammar.done):
                reason = "stop"
        if reason is None and len(self.output_ids) >= self.max_tokens:
            reason = "length"
        ids, held_text, lps = self._held
        ids, held_text = ids + [token_id], held_text + text
        lps = lps + ([lp] if lp else [])
        if reason is not None or (self._sent_prompt and len(ids) < self.stream_interval):
            # held: the last delta goes out with close(), the others once the interval fills
            self._held = (ids, held_text, lps)
            return reason
        self._held = ([], "", [])
        self._push(ids, held_text, lps)
        return None

    async def next_delta(self) -> RequestOutput:
        """The next delta; a consumer that fell behind gets every delta waiting as one (as
        vLLM's output collector merges them), so a slow stream costs one send a turn, not one
        a token."""
        waiting = [await self.queue.get()]
        while not waiting[-1].finished and not self.queue.empty():
            waiting.append(self.queue.get_nowait())
        return waiting[0] if len(waiting) == 1 else merge_outputs(waiting)

    def add_prompt_logprobs(self, scored: PromptLogprobs) -> None:
        """A prefill chunk's stages.protocol.PromptLogprobs; a recomputed chunk (after a
        preemption) changes nothing."""
        for j, (lp, rank) in enumerate(zip(scored.logprobs, scored.ranks)):
            pos = scored.start + j
            top = list(scored.top[j]) if scored.top else []
            self._prompt_lps.setdefault(pos, TokenLogprob(self.prompt_ids[pos], lp, top, rank))

    def _push(
        self,
        ids: list[int],
        text: str,
        lps: list[TokenLogprob],
        finished: bool = False,
        reason: str | None = None,
        error: str | None = None,
    ) -> None:
        out = RequestOutput(
            request_id=self.req_id,
            token_ids=ids,
            text=text,
            finished=finished,
            finish_reason=reason,
            prompt_tokens=len(self.prompt_ids),
            completion_tokens=len(self.output_ids),
            logprobs=lps if self.params.logprobs is not None else None,
            error=error,
        )
        if not self._sent_prompt:
            out.prompt_token_ids = list(self.prompt_ids)
            if self.params.prompt_logprobs is not None:
                first: list[TokenLogprob | None] = [None]
                out.prompt_logprobs = first + [
                    self._prompt_lps.get(p) for p in range(1, len(self.prompt_ids))
                ]
            self._sent_prompt = True
        self.queue.put_nowait(out)

    def close(
        self, reason: str, error: str | None = None, metrics: EngineMetrics | None = None
    ) -> None:
        if self.finished:
            return
        self.finished = True
        ids, text, lps = self._held
        if not self._stops.stopped:  # the tail held back for stop strings and partial chars
            tail, stopped = self._stops.feed(self._detok.flush())
            text += tail if stopped else tail + self._stops.flush()
        self._held = ([], "", [])
        self._push(ids, text, lps, finished=True, reason=reason, error=error)
        if metrics:
            metrics.observe_e2e(time.time() - self.arrival_time)
            metrics.request_finished(reason)
