"""vLLM's `priority` through the engine: one sequence slot, held by a running request; the
requests that queue behind it are admitted by priority (lower first), then by arrival,
whatever order they came in."""

from __future__ import annotations

import asyncio
import time

from app import Engine, EngineConfig, SamplingParams


def test_waiting_requests_are_admitted_by_priority_then_arrival(ray_cluster):
    cfg = EngineConfig(pp_size=1, device="cpu", max_num_seqs=1, num_kv_blocks=256,
                       stage_num_cpus=0.5)
    queued = [("b", 0), ("c", 0), ("urgent", -3), ("later", 2), ("d", 0)]

    async def run(engine: Engine) -> tuple[list[str], int]:
        done: list[str] = []

        async def one(name: str, prompt: list[int], params: SamplingParams) -> None:
            async for out in engine.stream(prompt, params):
                if out.finished:
                    done.append(name)

        first = asyncio.Event()

        async def blocker() -> None:  # holds the one slot for 1,500 decode steps (seconds)
            params = SamplingParams(max_tokens=1500, ignore_eos=True, temperature=0)
            async for out in engine.stream([5, 6, 7], params):
                first.set()
                if out.finished:
                    done.append("blocker")

        tasks = [asyncio.ensure_future(blocker())]
        await first.wait()
        for i, (name, priority) in enumerate(queued):
            params = SamplingParams(max_tokens=2, temperature=0, priority=priority)
            tasks.append(asyncio.ensure_future(one(name, [10 + i, 11, 12], params)))
            # one at a time: Ray may start concurrent calls to the coordinator in any order,
            # and the arrival order is part of what is tested
            deadline = time.monotonic() + 60
            while engine.stats()["num_waiting"] <= i and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
        waiting, finished_early = engine.stats()["num_waiting"], list(done)
        await asyncio.gather(*tasks)
        assert not finished_early, "the blocker ended before the others had queued"
        return done, waiting

    with Engine(cfg) as engine:
        done, waiting = asyncio.run(run(engine))
    assert waiting == len(queued)
    assert done == ["blocker", "urgent", "b", "c", "d", "later"]
