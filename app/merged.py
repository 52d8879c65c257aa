"""Several async streams read as one, each item tagged with its stream's key.

The ingress merges the PipelineServer calls of a batched prompt this way, and a PipelineServer
the n choices of one request. Closing the merge (or cancelling its reader) cancels every
source still running and waits for it; a source that never started is not closed, so owners
of abortable requests abort them themselves.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


class _End:
    """Marks the end of one source in the queue; `error` is what it raised, if it did."""

    def __init__(self, error: Exception | None = None) -> None:
        self.error = error


_END = _End()


class MergedStreams(Generic[K, T]):
    """(key, item) pairs in arrival order; one source's items keep their order. Sources may
    be added while reading. An exception a source raises is raised to the reader, after the
    items that source yielded before it."""

    def __init__(self) -> None:
        # (key, item), or (key, _END) when that source is done
        self._queue: asyncio.Queue[tuple[K, T | _End]] = asyncio.Queue()
        self._pumps: dict[K, asyncio.Task[None]] = {}
        self._open = 0

    def add(self, key: K, source: AsyncIterator[T]) -> None:
        if key in self._pumps:
            raise ValueError(f"stream {key!r} is already merged")
        self._open += 1
        self._pumps[key] = asyncio.ensure_future(self._pump(key, source))

    async def _pump(self, key: K, source: AsyncIterator[T]) -> None:
        end = _END
        try:
            async for item in source:
                self._queue.put_nowait((key, item))
        except Exception as e:  # the reader raises it: a task left holding it would be logged
            end = _End(e)
        finally:
            self._queue.put_nowait((key, end))

    async def __aiter__(self) -> AsyncIterator[tuple[K, T]]:
        try:
            while self._open:
                key, item = await self._queue.get()
                if isinstance(item, _End):
                    self._open -= 1
                    if item.error is not None:
                        raise item.error
                else:
                    yield key, item
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        """Cancel the sources still running and wait for them (nothing is left unawaited)."""
        running = [t for t in self._pumps.values() if not t.done()]
        for task in running:
            task.cancel()
        if running:
            await asyncio.gather(*running, return_exceptions=True)
