"""Creates one pipeline's stage actors in a placement group, joins their channels, sizes the KV
cache, and rebuilds everything when a stage fails."""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError
from ray.util.placement_group import (
    PlacementGroup,
    get_current_placement_group,
    placement_group_table,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from app.config import EngineConfig
from stages.actor import StageActor
from stages.model_config import ModelArgs
from stages.partition import layer_ranges
from stages.protocol import MicrobatchPlan, StageSpec, StepResult

log = logging.getLogger("ppserve.pipeline")

# Passed to every stage: NVLink multicast stays off on shared hosts (docs/ARCHITECTURE.md#channels).
_STAGE_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
COORDINATOR_CPUS = 0.1
# Ray then leaves CUDA_VISIBLE_DEVICES alone: the copy channel's CUDA IPC opens stage 0's buffer
# in the last stage, which needs stage 0's GPU visible there (stages/actor.py picks the device).
NOSET_VISIBLE_DEVICES = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"
# Stage actors are named in one fixed namespace, whoever started them (Engine driver, Serve
# replica), so operators find them with `ray list actors` or
# `ray.get_actor(name, namespace=STAGE_NAMESPACE)`.
STAGE_NAMESPACE = "ppserve"
# How long a teardown waits for the stages to close their channels before killing them. A stage
# that never answers is stuck in a recv from a dead peer, the common case in a rebuild, hence
# its short bound; the kill frees what close would have (the copy ring's /dev/shm name is gone
# once connected).
SHUTDOWN_CLOSE_S = 5.0
REBUILD_CLOSE_S = 1.0


def placement_bundles(config: EngineConfig) -> list[dict[str, float]]:
    """Bundle 0 holds the coordinator (or the Serve replica); bundles 1..S one stage each, with
    all its tensor-parallel ranks: a bundle lives on one node, so a stage's ranks share one
    (NVLink for their all-reduces) while the strategy places the stages."""
    tp = config.tp_size
    stage: dict[str, float]
    if config.device == "cuda":
        stage = {"GPU": tp, "CPU": tp}
    else:
        stage = {"CPU": config.stage_num_cpus * tp}
    return [{"CPU": COORDINATOR_CPUS}] + [dict(stage) for _ in range(config.pp_size)]


class PlacementTimeout(RuntimeError):
    """A pipeline's placement group was not placed in time."""


async def wait_placed(pg: PlacementGroup, timeout_s: float) -> None:
    """Wait until every bundle is placed. After a node is lost Ray reschedules its bundles; an
    actor created in one not yet placed would wait forever, so give up with a clear error."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        state = placement_group_table(pg).get("state")
        if state == "CREATED":
            return
        if loop.time() >= deadline:
            raise PlacementTimeout(
                f"the placement group of the pipeline is {state} after {timeout_s:g} s: its "
                f"bundles {pg.bundle_specs} (strategy {placement_group_table(pg).get('strategy')})"
                " do not fit on the cluster's live nodes"
            )
        await asyncio.sleep(0.2)


def _wait_closed(closing: list[Any], timeout_s: float) -> None:
    if closing:
        ray.wait(closing, num_returns=len(closing), timeout=timeout_s)


class StageStartError(RuntimeError):
    """A stage actor could not start; the message is the cause (Ray's wrapping removed)."""


# Errors whose message ppserve wrote, free of Ray's internals: fit for a client to read.
PUBLIC_ERRORS = (PlacementTimeout, StageStartError)


class Pipeline:
    def __init__(
        self,
        config: EngineConfig,
        args: ModelArgs,
        placement_group: PlacementGroup | None = None,
        stage_actor: Any = StageActor,
    ):
        """stage_actor: the Ray actor class of the stages (the bench's adds its knobs)."""
        self.config = config
        self.stage_actor = stage_actor
        self.args = args
        self.pg = placement_group or get_current_placement_group()
        # the stage actors' handles: per stage, its tensor-parallel ranks in rank order
        self.ranks: list[list[Any]] = []
        self.num_blocks = 0
        self.generation = 0  # bumped on every rebuild
        self.output_channel = "nccl"  # what the stages use, --output-channel resolved at start
        self.pipeline_id = uuid.uuid4().hex[:8]  # unique per Pipeline: names never collide
        # Deferred results (PP=1 with run-ahead): the last launched microbatch's result, which
        # the next advance call (the next dispatch or flush()) returns.
        self._uncollected: asyncio.Future[Any] | None = None

    @property
    def stages(self) -> list[Any]:
        """Each stage's rank 0, which reports the stage's StepResult."""
        return [ranks[0] for ranks in self.ranks]

    @property
    def actors(self) -> list[Any]:
        """Every rank of every stage."""
        return [a for ranks in self.ranks for a in ranks]

    @property
    def defers_results(self) -> bool:
        """One stage with run-ahead: a microbatch's result is collected after the next one is
        launched, so the device runs that step while this result returns to the coordinator
        (the host gap between decode steps; docs/PERFORMANCE.md)."""
        return len(self.stages) == 1 and self.config.resolved_run_ahead

    def stage_name(self, i: int, generation: int | None = None, tp_rank: int = 0) -> str:
        """`ppserve-<id>-stage<i>` (`...-stage<i>-tp<r>` for the ranks of a tensor-parallel
        stage); a rebuilt pipeline's actors get `ppserve-<id>-g<n>-stage<i>` so they never
        collide with the previous generation's actors while those die."""
        g = self.generation if generation is None else generation
        rank = f"-tp{tp_rank}" if self.config.tp_size > 1 else ""
        return f"ppserve-{self.pipeline_id}{f'-g{g}' if g else ''}-stage{i}{rank}"

    def _specs(self) -> list[list[StageSpec]]:
        """Per stage, its ranks' specs."""
        ranges = layer_ranges(self.args.num_hidden_layers, self.config.pp_size)
        max_len = self.config.resolved_max_model_len(self.args.max_position_embeddings)
        self.output_channel = self._resolve_output_channel()
        return [
            [
                self.config.stage_spec(i, r, max_len, self.output_channel, rank)
                for rank in range(self.config.tp_size)
            ]
            for i, r in enumerate(ranges)
        ]

    def _resolve_output_channel(self) -> str:
        """--output-channel, with auto resolved (and the choice logged once)."""
        chosen = self.config.output_channel
        if chosen != "auto":
            return chosen
        if self.generation == 0:
            log.info(
                "output channel: auto -> nccl%s (copy and host are not yet measured in a "
                "PP=2 decode; docs/PERFORMANCE.md)",
                " (gloo on CPU)" if self.config.device == "cpu" else "",
            )
        return "nccl"

    async def start(self) -> int:
        """Create the actors, join the channels, agree on the KV size. Returns the block count."""
        if self.pg is None:
            raise RuntimeError("the pipeline needs a placement group (see placement_bundles)")
        c = self.config
        await wait_placed(self.pg, c.placement_timeout_s)
        gpu = c.device == "cuda"
        specs = self._specs()
        env = dict(_STAGE_ENV)
        if specs[0][0].output_channel == "copy":  # CUDA IPC: each stage sees the node's GPUs
            env[NOSET_VISIBLE_DEVICES] = "1"
        self.ranks = [
            [
                self.stage_actor.options(
                    name=self.stage_name(i, tp_rank=spec.tp_rank),
                    namespace=STAGE_NAMESPACE,
                    num_cpus=0 if gpu else c.stage_num_cpus,
                    num_gpus=1 if gpu else 0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=self.pg, placement_group_bundle_index=i + 1
                    ),
                    runtime_env={"env_vars": env},
                ).remote(spec, c.torch_threads)
                for spec in stage_specs
            ]
            for i, stage_specs in enumerate(specs)
        ]
        await self._started()
        if c.pp_size > 1 or c.tp_size > 1:
            host, port = await self.stages[0].open_store.remote()
            await asyncio.gather(*[a.connect.remote(host, port) for a in self.actors])
        caps = await asyncio.gather(*[a.kv_capacity.remote() for a in self.actors])
        self.num_blocks = c.num_kv_blocks or min(caps)
        if self.num_blocks < 1:
            raise RuntimeError(f"no KV cache block fits the memory budget (per rank: {caps})")
        await asyncio.gather(*[a.allocate_kv.remote(self.num_blocks) for a in self.actors])
        # each stage logs its own KV bytes per token per layer (and the cache's dtype)
        log.info(
            "pipeline up: %d stages of %d tensor-parallel rank(s), %d KV blocks of %d tokens",
            c.pp_size,
            c.tp_size,
            self.num_blocks,
            c.kv_block_size,
        )
        return self.num_blocks

    async def _started(self) -> None:
        n = len(self.ranks)
        for i, stage in ((i, a) for i, ranks in enumerate(self.ranks) for a in ranks):
            try:
                await stage.started.remote()
            except RayTaskError as e:  # raised by the stage's own code: its error, unwrapped
                cause = e.cause if e.cause is not None else e
                raise StageStartError(
                    f"stage {i} of {n} could not start: {type(cause).__name__}: {cause}"
                ) from None
            except RayActorError as e:  # the process died (out of memory, runtime env...)
                log.error("stage %d of %d died while starting: %s", i, n, e)
                raise StageStartError(
                    f"stage {i} of {n} died while starting; see the Ray logs of its actor"
                ) from None

    def dispatch(self, plan: MicrobatchPlan) -> list[Any]:
        """Each stage's awaitable result of `plan` (Ray refs, or one coroutine when deferred).
        Every rank of a stage runs the plan; rank 0's result is the stage's."""
        n = len(self.ranks)
        if not self.defers_results:
            return [
                _stage_result([a.step.remote(plan.for_stage(i, n)) for a in ranks])
                for i, ranks in enumerate(self.ranks)
            ]
        advanced = self._advance(plan.for_stage(0, 1))
        self._settle_previous(advanced)
        result: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._uncollected = result
        return [self._deferred_result(advanced, result)]

    @staticmethod
    async def _deferred_result(advanced: Any, result: asyncio.Future[Any]) -> StepResult:
        await advanced  # a failed launch fails this microbatch at once
        step: StepResult = await (await result)
        return step

    def _settle_previous(self, ref: Any) -> None:
        """The previous microbatch's result is what `ref` (a later advance call) returns."""
        if self._uncollected is not None and not self._uncollected.done():
            self._uncollected.set_result(ref)
        self._uncollected = None

    def flush(self) -> None:
        """Return the last launched microbatch now (nothing else will be launched soon)."""
        if self._uncollected is not None:
            self._settle_previous(self._advance(None))

    def _advance(self, plan: MicrobatchPlan | None) -> Any:
        """advance() on every rank of the one stage: an awaitable (awaited twice: by this
        microbatch's launch and as the previous one's result) of rank 0's answer."""
        return _stage_result([a.advance.remote(plan) for a in self.ranks[0]])

    async def warm_up(self, chunks: list[tuple[int, int]]) -> list[dict[str, Any]]:
        """Every stage builds its attention kernels (and compiles the indexer's top-k) for these
        (prefix, tokens) chunk shapes."""
        warmed = await asyncio.gather(*[a.warm_up.remote(chunks) for a in self.actors])
        return list(warmed[:: self.config.tp_size])  # each stage's rank 0

    async def describe(self) -> list[dict[str, Any]]:
        """Per stage, rank 0's description with where each of its ranks runs."""
        described = await asyncio.gather(*[a.describe.remote() for a in self.actors])
        tp = self.config.tp_size
        out = []
        for i in range(len(self.ranks)):
            ranks = described[i * tp : (i + 1) * tp]
            keys = ("tp_rank", "pid", "node_ip", "node_id")
            out.append({**ranks[0], "ranks": [{k: r[k] for k in keys} for r in ranks]})
        return out

    def failed_stage(self, error: BaseException) -> int | None:
        """Which stage a Ray error came from (its actor id), if it names one of ours."""
        actor_id = getattr(error, "actor_id", None) or getattr(error, "_actor_id", None)
        for i, ranks in enumerate(self.ranks):
            if actor_id and any(a._actor_id.hex() == actor_id for a in ranks):
                return i
        return None

    def _close_stages(self) -> list[Any]:
        """Ask every rank to release its channels (the copy ring) before it is killed."""
        return [a.close.remote() for a in self.actors]

    def _end_actors(self) -> None:
        self._uncollected = None
        for a in self.actors:
            ray.kill(a, no_restart=True)
        self.ranks = []

    def kill(self) -> None:
        """Shutdown, or a start that failed: close the stages, then end them."""
        _wait_closed(self._close_stages(), SHUTDOWN_CLOSE_S)
        self._end_actors()

    async def rebuild(self) -> None:
        """A stage failed mid-microbatch: every channel may be out of step. Start afresh."""
        await asyncio.to_thread(_wait_closed, self._close_stages(), REBUILD_CLOSE_S)
        self._end_actors()
        self.generation += 1
        blocks = self.num_blocks
        await self.start()
        if self.num_blocks != blocks:  # the scheduler's pool was sized for the old count
            self.num_blocks = blocks
            await asyncio.gather(*[a.allocate_kv.remote(blocks) for a in self.actors])


def _stage_result(refs: list[Any]) -> Any:
    """One stage's awaitable result: its one rank's Ray ref, or a future of rank 0's result
    once every rank has finished (a failed rank fails the stage)."""
    if len(refs) == 1:
        return refs[0]

    async def leader() -> Any:
        return (await asyncio.gather(*refs))[0]

    return asyncio.ensure_future(leader())
