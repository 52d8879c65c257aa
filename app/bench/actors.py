"""The bench's own interface to a pipeline: a stage actor and a coordinator actor with the knobs a
benchmark turns between runs (policy, kernels, chunking) and the per-stage timings it reads.
The serving path carries none of this: app/bench/target.py's BenchEngine starts these actors
in place of the serving ones."""

from __future__ import annotations

import asyncio
import dataclasses
from collections import deque
from typing import Any

import ray

from app.bench.target import StageTiming
from app.config import EngineConfig
from app.coordinator import Coordinator
from app.engine import CoordinatorHost, Engine
from stages.actor import StageShell
from stages.protocol import MicrobatchPlan, StepResult


class BenchStage(StageShell):
    def set_policy(
        self, output_post: str | None = None, linear_backend: str | None = None
    ) -> dict[str, str]:
        """Between requests: where stage 0 posts output recvs, and which linear backend the
        layers call. Returns the stage's kernels."""
        runner = self.runner
        if output_post is not None:
            runner.output_slots.output_post = output_post
        if linear_backend is not None:
            names = runner.kernels.names
            runner.kernels = runner.kernels_for(
                linear_backend, names["attention"], names["mla_decode"]
            )
            for module in runner.model.modules():
                if hasattr(module, "kernels"):
                    setattr(module, "kernels", runner.kernels)
            if runner.decode_graphs is not None:  # the graphs hold the old kernels' launches
                runner._build_decode_graphs()
        return dict(runner.kernels.names, output_post=runner.output_slots.output_post)

    def flush_timings(self) -> tuple[tuple[int, float], ...]:
        """(mb_id, seconds) of forwards not yet reported: the last microbatches of a run on the
        stages before the last one complete after their step returned."""
        result: tuple[tuple[int, float], ...] = self.runner.timer.flush()
        return result


BenchStageActor = ray.remote(BenchStage)


class BenchCoordinator(Coordinator):
    """A coordinator that keeps every stage's forward times, newest last."""

    def __init__(self, config: EngineConfig, metrics: Any, placement_group: Any) -> None:
        super().__init__(config, metrics, placement_group, stage_actor=BenchStageActor)
        self.stage_timings: deque[StageTiming] = deque(maxlen=8192)

    def _retire(self, plan: MicrobatchPlan, results: list[StepResult]) -> None:
        for r in results:
            self.stage_timings.extend((r.stage, mb, sec) for mb, sec in r.timings)
        super()._retire(plan, results)


class BenchCoordinatorHost(CoordinatorHost):
    @property
    def bench(self) -> BenchCoordinator:
        c = self.coordinator
        if not isinstance(c, BenchCoordinator):
            raise RuntimeError("the bench's host runs a BenchCoordinator")
        return c

    def make_coordinator(self, config: EngineConfig, metrics: Any, pg: Any) -> BenchCoordinator:
        return BenchCoordinator(config, metrics, pg)

    async def set_policy(
        self,
        skip_mode: str | None = None,
        output_post: str | None = None,
        linear_backend: str | None = None,
        chunk_size: int | None = None,
        dynamic_chunking: bool | None = None,
        dynamic_chunk_smooth: float | None = None,
    ) -> list[dict[str, str]]:
        """One loaded pipeline measured under every policy: the options change as EngineConfig
        options (checked there), the scheduler's view is derived again. Idle pipelines only."""
        c = self.bench
        s = c.scheduler
        if s is None:
            raise RuntimeError("set_policy needs a started pipeline")
        if s.inflight or s.num_running or s.num_waiting:
            raise RuntimeError("set_policy needs an idle pipeline")
        changes: dict[str, Any] = {}
        if skip_mode is not None:
            changes["pp_output_skip"] = skip_mode
        if output_post is not None:
            changes["output_post"] = output_post
        if linear_backend is not None:
            changes["linear_backend"] = linear_backend
        if chunk_size is not None:
            changes.update(chunk_size=chunk_size, max_num_batched_tokens=chunk_size)
        if dynamic_chunking is not None:
            changes["enable_dynamic_chunking"] = dynamic_chunking
        if dynamic_chunk_smooth is not None:
            changes["dynamic_chunk_smooth"] = dynamic_chunk_smooth
        c.config = c.pipeline.config = dataclasses.replace(c.config, **changes)
        old = s.config
        s.config = c.config.scheduler_config(old.num_blocks, old.max_model_len, c.chunk_cost)
        kernels = await asyncio.gather(
            *[stage.set_policy.remote(output_post, linear_backend) for stage in c.pipeline.actors]
        )
        chunking = ("chunk_size", "chunk_cost", "dynamic_chunk_smooth")
        if any(getattr(old, k) != getattr(s.config, k) for k in chunking):
            await c.warm_up()  # the new chunking's shapes
        return list(kernels)[:: c.config.tp_size]  # each stage's rank 0

    async def take_timings(self) -> list[StageTiming]:
        """The stage timings gathered since the last call, with what the stages still hold once
        the pipeline is idle."""
        c = self.bench
        if c.scheduler is not None and not c.scheduler.inflight:
            stages = c.pipeline.stages
            flushed = await asyncio.gather(*[s.flush_timings.remote() for s in stages])
            for stage, timings in enumerate(flushed):
                c.stage_timings.extend((stage, mb, sec) for mb, sec in timings)
        out = list(c.stage_timings)
        c.stage_timings.clear()
        return out


class BenchDriver(Engine):
    """The Engine with the bench's coordinator actor, and its knobs."""

    coordinator_actor = ray.remote(BenchCoordinatorHost)

    def set_policy(self, **knobs: Any) -> list[dict[str, str]]:
        result: list[dict[str, str]] = ray.get(self._actor.set_policy.remote(**knobs))
        return result

    def take_timings(self) -> list[StageTiming]:
        result: list[StageTiming] = ray.get(self._actor.take_timings.remote())
        return result
