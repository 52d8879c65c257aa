"""The Python API: an Engine drives one pipeline through a coordinator running as a Ray actor.

    from app import Engine, EngineConfig, SamplingParams
    engine = Engine(EngineConfig(pp_size=2, device="cpu", chunk_size=64))
    outs = engine.generate(["a prompt", [1, 2, 3]], SamplingParams(max_tokens=16, temperature=0))
    engine.stats(); engine.shutdown()

`generate` blocks until every output is complete; `stream` yields one request's deltas.
"""

from __future__ import annotations

import asyncio
import os
from typing import TYPE_CHECKING, Any, AsyncIterator, Sequence

import ray
from ray.exceptions import RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from app.config import EngineConfig
from app.pipeline import COORDINATOR_CPUS, placement_bundles
from app.request import Prompt, RequestOutput, SamplingParams, merge_outputs
from stages.model_config import load_model_args
from stages.models.families import fp8_components

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup

    from app.coordinator import Coordinator
    from app.metrics import EngineMetrics
    from app.request_stream import RequestStream


class CoordinatorHost:
    """A Coordinator in its own process (as CoordinatorActor), for the Engine and tests; the
    bench's actor (app/bench/actors.py) subclasses it with its knobs."""

    def __init__(
        self, config: EngineConfig, pg: PlacementGroup | None = None, with_metrics: bool = False
    ):
        self._args = (config, pg, with_metrics)
        self._coordinator: Coordinator | None = None

    @property
    def coordinator(self) -> Coordinator:
        if self._coordinator is None:
            raise RuntimeError("the coordinator has not started")
        return self._coordinator

    def make_coordinator(
        self, config: EngineConfig, metrics: EngineMetrics | None, pg: PlacementGroup | None
    ) -> Coordinator:
        from app.coordinator import Coordinator

        return Coordinator(config, metrics=metrics, placement_group=pg)

    async def start(self) -> dict[str, Any]:
        # Built here rather than in __init__: an error raised by a method reaches the driver as
        # itself (RayTaskError.cause), one raised by __init__ only as an ActorDiedError's text.
        config, pg, with_metrics = self._args
        metrics = None
        if with_metrics:
            from app.metrics import EngineMetrics

            metrics = EngineMetrics(
                config.model_name,
                f"engine-{os.getpid()}",
                config.peak_rates,
                (config.pp_size, config.tp_size),
            )
        self._coordinator = self.make_coordinator(config, metrics, pg)
        await self.coordinator.start()
        return {
            "max_model_len": self.coordinator.max_model_len,
            "coordinator_node_id": ray.get_runtime_context().get_node_id(),
            "stages": await self.coordinator.pipeline.describe(),
        }

    async def generate_batch(
        self, prompts: list[Prompt], params: list[SamplingParams]
    ) -> list[RequestOutput]:
        streams = []
        try:  # validate all before running any: one bad prompt fails the call, nothing runs
            for p, sp in zip(prompts, params):
                streams.append(self.coordinator.add_request(p, sp))
        except Exception:
            for s in streams:
                self.coordinator.abort(s.req_id)
            raise
        return list(await asyncio.gather(*[self._collect(s) for s in streams]))

    @staticmethod
    async def _collect(stream: RequestStream) -> RequestOutput:
        deltas: list[RequestOutput] = []
        while not deltas or not deltas[-1].finished:
            deltas.append(await stream.queue.get())
        return merge_outputs(deltas)

    async def generate_stream(
        self, prompt: Prompt, params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        async for delta in self.coordinator.generate(prompt, params):
            yield delta

    def stats(self) -> dict[str, Any]:
        return self.coordinator.stats()

    def shutdown(self) -> bool:
        if self._coordinator is not None:
            self._coordinator.shutdown()
        return True


CoordinatorActor = ray.remote(CoordinatorHost)


class Engine:
    coordinator_actor: Any = CoordinatorActor  # the bench's engine runs its own (app/bench/)

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        num_cpus: int | None = None,
        with_metrics: bool = False,
    ):
        self.config = config or EngineConfig()
        # A missing directory, no config.json, an unsupported model_type or a KV cache dtype
        # the model cannot use raises here, before Ray or any actor starts.
        args = load_model_args(self.config.model)
        fp8_components(args, self.config.kv_cache_dtype)
        self.config = self.config.for_model(args)
        self._owns_ray = not ray.is_initialized()
        self._pg: PlacementGroup | None = None
        self._actor: Any = None  # the coordinator actor's handle
        if self._owns_ray:  # a laptop: a local cluster with enough logical CPUs for the stages
            ranks = self.config.pp_size * self.config.tp_size
            need = int(ranks * self.config.stage_num_cpus + 2)
            # address="local": a cluster of its own, even where `ray start` left one running
            ray.init(
                address="local",
                num_cpus=num_cpus or max(4, need),
                include_dashboard=False,
                log_to_driver=False,
            )
        try:
            self._pg = placement_group(
                placement_bundles(self.config), strategy=self.config.placement_strategy
            )
            ray.get(self._pg.ready(), timeout=self.config.placement_timeout_s)
            self._actor = self.coordinator_actor.options(
                num_cpus=COORDINATOR_CPUS,
                max_concurrency=1000,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self._pg, placement_group_bundle_index=0
                ),
            ).remote(self.config, self._pg, with_metrics)
            self.info: dict[str, Any] = ray.get(self._actor.start.remote())
        except BaseException as e:
            # Everything this construction took is given back, so another Engine can start.
            self._release()
            if isinstance(e, RayTaskError) and isinstance(e.cause, Exception):
                raise e.cause from None  # the cause itself, not Ray's wrapper
            raise

    @property
    def max_model_len(self) -> int:
        return int(self.info["max_model_len"])

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Prompts are strings or lists of token ids; one SamplingParams for all, or one each."""
        one = isinstance(prompts, str) or (prompts and isinstance(prompts[0], int))
        batch = [prompts] if one else list(prompts)
        params = sampling_params or SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(batch)
        outputs: list[RequestOutput] = ray.get(
            self._actor.generate_batch.remote(batch, list(params))
        )
        return outputs

    async def stream(self, prompt: Prompt, params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Streamed deltas of one request (an async generator over a Ray streaming call)."""
        async for ref in self._actor.generate_stream.remote(prompt, params):
            yield await ref

    def stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = ray.get(self._actor.stats.remote())
        return stats

    def shutdown(self) -> None:
        self._release()

    def _release(self) -> None:
        """Stop the coordinator (its stage actors go with it), remove the placement group, and
        stop the Ray cluster if this Engine started it."""
        if self._actor is not None:
            try:
                ray.get(self._actor.shutdown.remote(), timeout=60)
            except Exception:
                pass
            ray.kill(self._actor, no_restart=True)
            self._actor = None
        if self._pg is not None:
            remove_placement_group(self._pg)
            self._pg = None
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
