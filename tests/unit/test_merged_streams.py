"""MergedStreams: items tagged by source in order, sources added while reading, a source's
exception raised to the reader, and closing cancels the sources still running."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from app.merged import MergedStreams


async def numbers(start: int, count: int, delay: float = 0.0) -> AsyncIterator[int]:
    for i in range(start, start + count):
        await asyncio.sleep(delay)
        yield i


def test_each_source_in_order_and_added_while_reading() -> None:
    async def run() -> list[tuple[str, int]]:
        merged: MergedStreams[str, int] = MergedStreams()
        merged.add("a", numbers(0, 3))
        got = []
        async for key, item in merged:
            got.append((key, item))
            if key == "a" and item == 0:
                merged.add("b", numbers(10, 2))
        return got

    got = asyncio.run(run())
    assert [i for k, i in got if k == "a"] == [0, 1, 2]
    assert [i for k, i in got if k == "b"] == [10, 11]


def test_a_source_error_reaches_the_reader_after_its_items() -> None:
    async def failing() -> AsyncIterator[int]:
        yield 1
        raise ValueError("boom")

    async def run() -> list[int]:
        merged: MergedStreams[int, int] = MergedStreams()
        merged.add(0, failing())
        got = []
        with pytest.raises(ValueError, match="boom"):
            async for _, item in merged:
                got.append(item)
        return got

    assert asyncio.run(run()) == [1]


def test_closing_cancels_running_sources() -> None:
    closed = []

    async def endless() -> AsyncIterator[int]:
        try:
            while True:
                await asyncio.sleep(0.01)
                yield 0
        finally:
            closed.append(True)

    async def run() -> None:
        merged: MergedStreams[int, int] = MergedStreams()
        merged.add(0, endless())
        async for _ in merged:
            break
        await merged.aclose()

    asyncio.run(run())
    assert closed == [True]
