"""The coordinator of one pipeline: admits requests, runs the scheduler, dispatches plans to the
stages, applies results, streams tokens back, owns the metrics.

It is a plain class with an asyncio API: the Serve PipelineServer holds one, and the Python
Engine runs one inside a Ray actor.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any, AsyncIterator

from app.config import EngineConfig
from app.model_cost import ModelCost
from app.pipeline import PUBLIC_ERRORS, Pipeline
from app.request import InvalidRequest, Overloaded, RequestOutput, SamplingParams
from app.request_stream import RequestStream
from app.scheduler import ChunkCost, PrefixCacheStats, SchedRequest, Scheduler
from app.structured import Grammars
from app.tokenizer import load_tokenizer
from stages.actor import StageActor
from stages.model_config import load_model_args
from stages.protocol import MicrobatchPlan, StepResult

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup

    from app.metrics import EngineMetrics

log = logging.getLogger("ppserve.coordinator")

# How often an idle coordinator reports its load gauges (Ray exports every few seconds and
# drops a gauge left unrecorded for two export intervals).
LOAD_REPORT_S = 1.0


class Coordinator:
    def __init__(
        self,
        config: EngineConfig,
        metrics: EngineMetrics | None = None,
        placement_group: PlacementGroup | None = None,
        stage_actor: Any = StageActor,
    ):
        self.args = load_model_args(config.model)
        self.config = config = config.for_model(self.args)
        self.metrics = metrics
        self.tokenizer = load_tokenizer(config.model)
        self.max_model_len = config.resolved_max_model_len(self.args.max_position_embeddings)
        # A checkpoint without tokenizer.json still stops on its own config's EOS ids.
        self.eos_token_ids = tuple(
            dict.fromkeys(
                (*self.tokenizer.eos_token_ids, *(self.args.eos_token_ids if config.model else ()))
            )
        )
        self.pipeline = Pipeline(config, self.args, placement_group, stage_actor)
        self.grammars = Grammars(self.tokenizer, self.args.vocab_size, self.eos_token_ids)
        # dynamic chunking's cost model: the model's FLOPs per layer
        self.chunk_cost = ChunkCost.for_model(self.args)
        self.model_cost = ModelCost.for_engine(config, self.args.fp8_block is not None)
        self.scheduler: Scheduler | None = None
        self._streams: dict[str, RequestStream] = {}
        # (plan, asyncio.Future of all stages' results)
        self._inflight: deque[tuple[MicrobatchPlan, asyncio.Future[list[StepResult]]]] = deque()
        self._wakeup = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._ids = itertools.count()
        self._channel_sends = 0
        self._stage_forward = [0.0] * config.pp_size
        self._graph_steps = [0] * config.pp_size  # microbatches each stage replayed as a graph
        self._fallbacks: Counter[str] = Counter()  # "op/backend/reason" -> kernel fallbacks
        self._failures = 0
        self._broken: str | None = None  # set when the pipeline cannot be rebuilt
        self._rebuilding = False  # between a stage failure and the rebuilt pipeline
        # per stage: attention shapes built at startup, seconds
        self._warmup: list[dict[str, Any]] = []

    # -- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the pipeline; on failure its stage actors are killed before the error rises."""
        try:
            grammars = asyncio.ensure_future(asyncio.to_thread(self.grammars.prepare))
            num_blocks = await self.pipeline.start()
            await grammars  # built while the stages load
            self.scheduler = Scheduler(
                self.config.scheduler_config(num_blocks, self.max_model_len, self.chunk_cost),
                self._output_event,
                self._prefix_lookup,
            )
            await self.warm_up()
            self._loop_task = asyncio.create_task(self._run())
            await self._first_request()
        except BaseException:
            self.shutdown()
            raise

    async def warm_up(self) -> None:
        """Stages build their attention kernels (and compile the indexer's top-k and the routed
        experts' kernels) for a long lone prompt's chunk shapes."""
        c, s = self.config, self._started.config
        length = c.warmup_len
        if length is None:
            length = min(self.max_model_len, self.pipeline.num_blocks * c.kv_block_size)
        if length <= 0 or c.device != "cuda":
            return
        self._warmup = await self.pipeline.warm_up(s.lone_prompt_chunks(length))
        log.info("kernel warm-up for prompts up to %d tokens: %s", length, self._warmup)

    async def _first_request(self) -> None:
        """On CUDA, one short request (two chunks, two tokens) through the whole pipeline
        before serving: NCCL's channels, cuBLAS, the sampler and Triton's kernels initialise
        on first use, which the first served request would pay for (docs/PERFORMANCE.md). Not
        counted in the metrics."""
        c = self.config
        if c.device != "cuda" or self.max_model_len < 3:
            return
        n = min(2 * c.chunk_size, self.max_model_len - 2)
        prompt = [i % self.args.vocab_size for i in range(n)]
        metrics, self.metrics = self.metrics, None
        try:
            async for _ in self.generate(
                prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
            ):
                pass
        finally:
            self.metrics = metrics
            self._started.prefix_stats = PrefixCacheStats()  # not counted, as in the metrics

    @property
    def _started(self) -> Scheduler:
        if self.scheduler is None:
            raise RuntimeError("the coordinator is not started")
        return self.scheduler

    def shutdown(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
        self.pipeline.kill()

    # -- requests --------------------------------------------------------------------------------
    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < self.args.vocab_size]
            if bad:
                raise InvalidRequest(
                    f"token id {bad[0]} is out of range for a vocabulary of "
                    f"{self.args.vocab_size}.",
                    param="prompt",
                )
        if not ids:
            raise InvalidRequest("the prompt is empty.", param="prompt")
        return ids

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        arrival_time: float | None = None,
    ) -> RequestStream:
        """Validate and queue; raises InvalidRequest before anything is queued."""
        if self.scheduler is None:
            raise RuntimeError("the coordinator is not started")
        if self._broken:
            raise InvalidRequest(self._broken, status=503)
        ids = self._prompt_ids(prompt)
        room = self.max_model_len - len(ids)
        if room < 1:
            raise InvalidRequest(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your prompt has {len(ids)} tokens; no room is left for a completion.",
                param="prompt",
            )
        max_tokens = params.max_tokens if params.max_tokens is not None else room
        if max_tokens > room:
            raise InvalidRequest(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {len(ids) + max_tokens} tokens ({len(ids)} in the prompt, "
                f"{max_tokens} for the completion). Please reduce the prompt or max_tokens.",
                param="max_tokens",
            )
        params.check_vocab(self.args.vocab_size)
        limit = self.config.max_waiting_requests
        if limit is not None and self.scheduler.num_waiting >= limit:
            raise Overloaded(
                f"The server is overloaded: {self.scheduler.num_waiting} requests "
                "are waiting already. Please retry later."
            )
        req_id = request_id or f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        if req_id in self._streams:
            raise InvalidRequest(f"request id {req_id!r} is already in use.")
        spec = params.to_spec(self.eos_token_ids, self._bad_words_ids(params.bad_words))
        grammar = self.grammars.matcher(params.structured) if params.structured else None
        try:
            self.scheduler.add(
                SchedRequest(
                    req_id,
                    tuple(ids),
                    max_tokens,
                    spec,
                    params.logprobs is not None,
                    grammar is not None,
                    params.priority,
                )
            )
        except ValueError as e:
            raise InvalidRequest(str(e), param="prompt") from e
        stream = RequestStream(
            req_id,
            ids,
            params,
            max_tokens,
            self.tokenizer,
            self.eos_token_ids,
            arrival_time or time.time(),
            grammar,
            self.config.stream_interval,
        )
        self._streams[req_id] = stream
        if self.metrics:
            self.metrics.add_tokens(prompt=len(ids))
        self._wakeup.set()
        return stream

    def _bad_words_ids(self, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        """Each bad word as tokens, alone and after a space (as vLLM tokenizes them)."""
        seqs: dict[tuple[int, ...], None] = {}
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))
                if ids:
                    seqs[ids] = None
        return tuple(seqs)

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        arrival_time: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        stream = self.add_request(prompt, params, request_id, arrival_time)
        async for out in self.outputs(stream):
            yield out

    async def outputs(self, stream: RequestStream) -> AsyncIterator[RequestOutput]:
        """A queued request's deltas; a consumer that goes away aborts it and frees its
        blocks."""
        try:
            while True:
                out = await stream.next_delta()
                yield out
                if out.finished:
                    return
        finally:
            if not stream.finished:
                self.abort(stream.req_id)

    def abort(self, req_id: str) -> None:
        stream = self._streams.get(req_id)
        if stream is None or stream.finished:
            return
        self._finish(stream, "abort")

    # -- the loop: schedule -> dispatch -> retire -------------------------------------------------
    async def _run(self) -> None:
        while True:
            self._dispatch_ready()
            self._report_load()
            if not self._inflight:
                self._wakeup.clear()
                # Nothing runnable: sleep until a request arrives (or poll briefly if work
                # waits); idle, wake now and then to report the load gauges again.
                timeout = 0.05 if self._started.has_work() else LOAD_REPORT_S
                try:
                    await asyncio.wait_for(self._wakeup.wait(), timeout)
                except asyncio.TimeoutError:
                    pass
                continue
            plan, fut = self._inflight[0]
            if not fut.done():
                # Watch every microbatch in flight, not only the oldest: a dead stage may fail
                # only younger ones while the oldest waits on a peer blocked in a recv from it
                # (NCCL never reports a dead peer).
                waits: set[asyncio.Future[Any]] = {f for _p, f in self._inflight if not f.done()}
                wake = None
                if len(self._inflight) < self.config.inflight:
                    self._wakeup.clear()
                    wake = asyncio.ensure_future(self._wakeup.wait())
                    waits.add(wake)
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                if wake is not None:
                    wake.cancel()
            failed = next(
                (
                    (p, e)
                    for p, f in self._inflight
                    if f.done() and not f.cancelled() and (e := f.exception()) is not None
                ),
                None,
            )
            if failed is not None:  # a stage failed: channels are out of step
                await self._recover(*failed)
                continue
            if not fut.done():
                continue  # woken by a new request: dispatch it before retiring
            self._inflight.popleft()
            self._retire(plan, fut.result())

    def _dispatch_ready(self) -> None:
        while True:
            plan = self._started.schedule()
            if plan is None:
                if len(self._inflight) < self.config.inflight:  # room, but nothing to launch
                    self.pipeline.flush()
                return
            now = time.time()
            for row in plan.rows:
                stream = self._streams.get(row.req_id)
                if stream is not None and stream.scheduled_time is None:
                    stream.scheduled_time = now
                    if self.metrics:
                        self.metrics.observe_queue_time(now - stream.arrival_time)
            plan = self._with_masks(plan)
            refs = self.pipeline.dispatch(plan)
            self._inflight.append((plan, asyncio.ensure_future(asyncio.gather(*refs))))

    def _with_masks(self, plan: MicrobatchPlan) -> MicrobatchPlan:
        """The plan with the token masks of its constrained sampling rows: their previous
        tokens have all retired (the scheduler does not run them ahead), so each matcher is
        where the row samples."""
        masks = []
        for row in plan.rows:
            stream = self._streams.get(row.req_id)
            if row.sample and stream is not None and stream.grammar is not None:
                masks.append((row.req_id, stream.grammar.mask()))
        return replace(plan, token_masks=tuple(masks)) if masks else plan

    def _retire(self, plan: MicrobatchPlan, results: list[StepResult]) -> None:
        last = results[-1]
        for r in results:
            self._stage_forward[r.stage] += r.forward_s
            self._graph_steps[r.stage] += r.graphed
            for c in r.fallbacks:
                self._fallbacks[f"{c.op}/{c.backend}/{c.reason}"] += c.count
            if self.metrics:
                self.metrics.observe_stage_forward(r.stage, r.forward_s)
                self.metrics.kernel_fallbacks(r.fallbacks)
        if self.metrics and self.model_cost:  # distance to the hardware: work / busy time
            # GPU-seconds: a stage of N tensor-parallel ranks keeps N GPUs busy
            busy = sum(r.forward_s for r in results) * self.config.tp_size
            self.metrics.model_work(self.model_cost.step(plan.rows), busy)
        self._channel_sends = max(self._channel_sends, last.output_sends)
        by_req = {s.req_id: s for s in last.sampled}
        for scored in last.prompt_logprobs:  # before the first token, which carries them
            stream = self._streams.get(scored.req_id)
            if stream is not None:
                stream.add_prompt_logprobs(scored)
        events = self._started.retire(plan.mb_id, [(s.req_id, s.token_id) for s in last.sampled])
        for req_id, token_id, _index in events:
            stream = self._streams.get(req_id)
            if stream is None or stream.finished:
                continue
            reason = stream.append(token_id, by_req[req_id], self.metrics)
            if reason is not None:
                self._finish(stream, reason, stream.error)

    def _finish(self, stream: RequestStream, reason: str, error: str | None = None) -> None:
        self._started.finish(stream.req_id, reason)
        stream.close(reason, error, self.metrics)
        self._streams.pop(stream.req_id, None)
        self._wakeup.set()

    async def _recover(self, failed_plan: MicrobatchPlan, error: BaseException) -> None:
        """Fail what was in flight with a clear error, rebuild the pipeline, carry on. The
        requests' error names the failed stage; Ray's detail (actor ids, pids, node, traceback)
        goes to the log only."""
        self._failures += 1
        self._rebuilding = True
        if self.metrics:
            self.metrics.pipeline_rebuilt()
        stage = self.pipeline.failed_stage(error)
        which = "a stage" if stage is None else f"stage {stage} of {self.config.pp_size}"
        log.error(
            "%s failed in microbatch %d; rebuilding the pipeline: %s",
            which,
            failed_plan.mb_id,
            error,
        )
        for _plan, fut in self._inflight:
            fut.cancel()
        self._inflight.clear()
        msg = (
            f"The pipeline failed while running this request ({which} stopped) and was "
            "restarted; please retry."
        )
        for req_id in self._started.abort_inflight("error"):
            stream = self._streams.pop(req_id, None)
            if stream is not None:
                stream.close("error", msg, self.metrics)
        # Requests part-way through (their KV lived on the old stages) cannot continue either;
        # requests still waiting lose nothing.
        for stream in list(self._streams.values()):
            if stream.scheduled_time is not None:
                self._finish(stream, "error", msg)
        for attempt in range(3):
            try:
                await self.pipeline.rebuild()
                await self.warm_up()
                self._rebuilding = False
                return
            except Exception as e:  # e.g. the new actors cannot be placed yet
                log.error("pipeline rebuild failed (attempt %d): %s", attempt + 1, e)
                cause = f": {e}" if isinstance(e, PUBLIC_ERRORS) else ""
                await asyncio.sleep(2**attempt)
        # Out of service: new requests get a 503, and stats()/health checks raise so that Serve
        # replaces this replica (a fresh pipeline) instead of leaving requests hanging.
        self._broken = f"The pipeline is down and could not be rebuilt{cause}; please retry later."
        for stream in list(self._streams.values()):
            self._finish(stream, "error", self._broken)

    def _output_event(self, event: str, counts: Mapping[str, int]) -> None:
        if self.metrics:
            self.metrics.output_event(event, counts)

    def _prefix_lookup(self, queried: int, hit: int) -> None:
        if self.metrics:
            self.metrics.prefix_lookup(queried, hit)

    def _report_load(self) -> None:
        if self.metrics:
            s = self._started
            self.metrics.set_load(s.num_running, s.num_waiting, s.kv_usage)

    # -- introspection ---------------------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        """{"status": "ok"}, or "degraded" while the pipeline is rebuilt after a stage failure
        (requests then wait in the queue); raises when it cannot serve at all (as stats())."""
        self.stats()
        if self._rebuilding:
            return {
                "status": "degraded",
                "message": "A pipeline stage failed; the pipeline is being rebuilt.",
            }
        return {"status": "ok"}

    def stats(self) -> dict[str, Any]:
        if self._broken:
            raise RuntimeError(self._broken)
        if (
            self._loop_task is not None
            and self._loop_task.done()
            and not self._loop_task.cancelled()
            and self._loop_task.exception() is not None
        ):
            raise RuntimeError(f"the coordinator loop died: {self._loop_task.exception()!r}")
        s = self._started
        return {
            "pp_output_comm": dict(s.comm_stats()),
            "channel_output_sends": self._channel_sends,
            "output_channel": self.pipeline.output_channel,
            "pp_size": self.config.pp_size,
            "tp_size": self.config.tp_size,
            "num_running": s.num_running,
            "num_waiting": s.num_waiting,
            "inflight_microbatches": s.inflight,
            "waiting_prompt_tokens": s.waiting_prompt_tokens,
            "kv_cache_usage": s.kv_usage,
            "kv_capacity_tokens": self.pipeline.num_blocks * self.config.kv_block_size,
            "kv_blocks_total": self.pipeline.num_blocks,
            "kv_blocks_free": s.pool.num_free,
            "slots_free": s.num_free_slots,
            "num_preemptions": s.num_preemptions,
            "prefix_cache_queries": s.prefix_stats.queries,
            "prefix_cache_hits": s.prefix_stats.hits,
            "kv_blocks_cached": s.pool.num_cached,
            "stage_forward_seconds": list(self._stage_forward),
            "decode_graph_steps": list(self._graph_steps),
            "kernel_fallbacks": dict(self._fallbacks),
            "pipeline_failures": self._failures,
            "pipeline_rebuilding": self._rebuilding,
            "pipeline_id": self.pipeline.pipeline_id,
            "max_model_len": self.max_model_len,
            "attention_warmup": list(self._warmup),
        }
