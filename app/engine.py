"""The Python API: an Engine drives one pipeline through a coordinator running as a Ray actor.

    from app import Engine, EngineConfig, SamplingParams
    engine = Engine(EngineConfig(pp_size=2, device="cpu", chunk_size=64))
    outs = engine.generate(["a prompt", [1, 2, 3]], SamplingParams(max_tokens=16, temperature=0))
    engine.stats(); engine.shutdown()
"""

from __future__ import annotations

import asyncio
import inspect
import os
from typing import AsyncIterator, Sequence

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from app.config import EngineConfig
from app.pipeline import COORDINATOR_CPUS, placement_bundles
from app.request import RequestOutput, SamplingParams


def merge_outputs(deltas: list[RequestOutput]) -> RequestOutput:
    """Fold a request's streamed deltas into one whole result."""
    first, last = deltas[0], deltas[-1]
    lps = [lp for d in deltas for lp in (d.logprobs or [])]
    return RequestOutput(
        request_id=first.request_id, token_ids=[t for d in deltas for t in d.token_ids],
        text="".join(d.text for d in deltas), finished=last.finished,
        finish_reason=last.finish_reason, prompt_tokens=last.prompt_tokens,
        completion_tokens=last.completion_tokens,
        logprobs=lps if first.logprobs is not None or lps else None, error=last.error,
        prompt_token_ids=first.prompt_token_ids)


@ray.remote
class CoordinatorActor:
    """A Coordinator in its own process, for the Engine, tests and the bench."""

    def __init__(self, config: EngineConfig, pg=None, with_metrics: bool = False):
        from app.coordinator import Coordinator

        metrics = None
        if with_metrics:
            from app.metrics import EngineMetrics

            metrics = EngineMetrics(config.model_name, f"engine-{os.getpid()}")
        self.coordinator = Coordinator(config, metrics=metrics, placement_group=pg)

    async def start(self) -> dict:
        await self.coordinator.start()
        return {"max_model_len": self.coordinator.max_model_len,
                "stages": await self.coordinator.pipeline.describe()}

    async def generate_batch(self, prompts: list, params: list[SamplingParams]) -> list:
        streams = []
        try:  # validate all before running any: one bad prompt fails the call, nothing runs
            for p, sp in zip(prompts, params):
                streams.append(self.coordinator.add_request(p, sp))
        except Exception:
            for s in streams:
                self.coordinator.abort(s.req_id)
            raise
        return await asyncio.gather(*[self._collect(s) for s in streams])

    @staticmethod
    async def _collect(stream) -> RequestOutput:
        deltas = []
        while not deltas or not deltas[-1].finished:
            deltas.append(await stream.queue.get())
        return merge_outputs(deltas)

    async def generate_stream(self, prompt, params: SamplingParams):
        async for delta in self.coordinator.generate(prompt, params):
            yield delta

    def stats(self) -> dict:
        return self.coordinator.stats()

    async def call(self, fn, *args, **kwargs):
        """fn(coordinator, *args, **kwargs) in this process, awaited if it is a coroutine:
        how benchmarks (app/bench/) reach inside without plumbing of their own here."""
        result = fn(self.coordinator, *args, **kwargs)
        return await result if inspect.isawaitable(result) else result

    def shutdown(self) -> bool:
        self.coordinator.shutdown()
        return True


class Engine:
    def __init__(self, config: EngineConfig | None = None, *, num_cpus: int | None = None,
                 with_metrics: bool = False):
        self.config = config or EngineConfig()
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:  # a laptop: a local cluster with enough logical CPUs for the stages
            need = int(self.config.pp_size * self.config.stage_num_cpus + 2)
            ray.init(num_cpus=num_cpus or max(4, need), include_dashboard=False,
                     log_to_driver=False)
        self._pg = placement_group(placement_bundles(self.config),
                                   strategy=self.config.placement_strategy)
        ray.get(self._pg.ready(), timeout=self.config.placement_timeout_s)
        self._actor = CoordinatorActor.options(
            num_cpus=COORDINATOR_CPUS, max_concurrency=1000,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self._pg, placement_group_bundle_index=0),
        ).remote(self.config, self._pg, with_metrics)
        self.info = ray.get(self._actor.start.remote())

    @property
    def max_model_len(self) -> int:
        return self.info["max_model_len"]

    def generate(self, prompts: str | list | Sequence,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 ) -> list[RequestOutput]:
        """Prompts are strings or lists of token ids; one SamplingParams for all, or one each."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        return ray.get(self._actor.generate_batch.remote(list(prompts), list(params)))

    async def stream(self, prompt, params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Streamed deltas of one request (an async generator over a Ray streaming call)."""
        async for ref in self._actor.generate_stream.remote(prompt, params):
            yield await ref

    def stats(self) -> dict:
        return ray.get(self._actor.stats.remote())

    def call(self, fn, *args, **kwargs):
        """fn(coordinator, *args, **kwargs), run inside the coordinator's actor."""
        return ray.get(self._actor.call.remote(fn, *args, **kwargs))

    def shutdown(self) -> None:
        try:
            ray.get(self._actor.shutdown.remote(), timeout=60)
        except Exception:
            pass
        ray.kill(self._actor, no_restart=True)
        remove_placement_group(self._pg)
        if self._owns_ray:
            ray.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
