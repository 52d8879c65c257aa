"""GPU tests: marked ``gpu`` and skipped where CUDA is not available. Their engine helpers that
need no GPU themselves live here too."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA (run on the GPU host)")


async def stream_staggered(
    engine: Any, prompts: Sequence[Any], params: Any, waves: Sequence[Sequence[int]], gap: int
) -> list[Any]:
    """Each prompt's whole output (a RequestOutput, in the prompts' order), the prompts arriving
    in `waves` (indices into prompts): the first wave at once, each later one as soon as a
    request of the wave before has streamed `gap` tokens (or finished). So later arrivals come a
    few decode steps apart, and their prefill chunks share forwards with earlier requests'
    decode rows (and chunks), which lone runs never do; inside a wave they arrive together."""
    from app.request import merge_outputs

    if sorted(i for wave in waves for i in wave) != list(range(len(prompts))):
        raise ValueError("the waves must name every prompt once")
    ready = [asyncio.Event() for _ in waves]  # a request of wave w has streamed `gap` tokens
    outputs: dict[int, Any] = {}

    async def one(i: int, wave: int) -> None:
        if wave:
            await ready[wave - 1].wait()
        deltas: list[Any] = []
        async for delta in engine.stream(prompts[i], params):
            deltas.append(delta)
            if sum(len(d.token_ids) for d in deltas) >= gap:
                ready[wave].set()
        ready[wave].set()
        outputs[i] = merge_outputs(deltas)

    await asyncio.gather(*(one(i, w) for w, wave in enumerate(waves) for i in wave))
    return [outputs[i] for i in range(len(prompts))]
