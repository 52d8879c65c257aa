"""The PipelineServer calls of one OpenAI request, and their cancellation.

One call per prompt (a batched /v1/completions prompt is several), each answering its n
choices. Every way the ingress stops listening — a client that disconnects or times out while
the call is queued in Serve, waiting for admission, prefilling or decoding, streamed or not —
cancels the calls it has not read to the end, which aborts their requests in the coordinator
(PipelineServer.generate), freeing their slots and KV blocks.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from ray.exceptions import TaskCancelledError
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from app.merged import MergedStreams
from app.messages import PIPELINE_UNAVAILABLE, Accepted, Delta, Failure, GenerateRequest
from app.openai.availability import ReplicaWatch


class PipelineCalls:
    def __init__(self, server: Any, replicas: ReplicaWatch, requests: list[GenerateRequest]):
        self._n = requests[0].n
        self._gens = [server.options(stream=True).generate.remote(r) for r in requests]
        self._replicas = replicas
        self._finished: set[int] = set()  # the calls read to their end

    async def accept(self) -> list[Accepted] | Failure:
        """Every call's first reply: all queued, or the first refusal (the others are then
        cancelled)."""
        firsts = await asyncio.gather(*[self._first(g) for g in self._gens])
        accepted = [f for f in firsts if isinstance(f, Accepted)]
        if len(accepted) < len(firsts):
            self.cancel()
            return next(f for f in firsts if isinstance(f, Failure))
        return accepted

    async def _first(self, gen: Any) -> Accepted | Failure:
        try:
            reply: Accepted | Failure = await self._replicas.first(gen.__anext__(), gen.cancel)
            return reply
        except TaskCancelledError:
            raise  # cancelled: the client went away
        except Exception as e:  # the replica died, or is being replaced
            return Failure.internal(PIPELINE_UNAVAILABLE, e)

    async def replies(self) -> AsyncGenerator[tuple[int, Delta | Failure], None]:
        """(choice index, reply) of all calls as they come: prompt p's choice j is p * n + j."""
        merged: MergedStreams[int, Delta | Failure] = MergedStreams()
        for p, gen in enumerate(self._gens):
            merged.add(p, self._replies(p, gen))
        try:
            async for p, reply in merged:
                yield p * self._n + (reply.index if isinstance(reply, Delta) else 0), reply
        finally:
            await merged.aclose()

    async def _replies(self, p: int, gen: Any) -> AsyncIterator[Delta | Failure]:
        """One call's replies after Accepted; a replica that dies mid-request is one more
        Failure."""
        finished = 0
        try:
            async for reply in gen:
                yield reply
                if isinstance(reply, Failure):
                    return
                finished += reply.out.finished
            self._finished.add(p)
        except TaskCancelledError:
            raise
        except Exception as e:
            yield Failure.internal(PIPELINE_UNAVAILABLE, e)
            return
        if finished < self._n:  # the stream ended short: Serve cancelled the call under us
            raise TaskCancelledError()

    def cancel(self) -> None:
        """Cancel the calls not read to their end (idempotent)."""
        for p, gen in enumerate(self._gens):
            if p not in self._finished:
                gen.cancel()


class CallsStream(StreamingResponse):
    """SSE of `calls` that cancels them when the response ends, however it ends (a client
    gone before the first chunk included, when the body iterator never starts)."""

    def __init__(self, content: AsyncIterator[str], calls: PipelineCalls):
        super().__init__(content, media_type="text/event-stream")
        self.calls = calls

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except TaskCancelledError:
            raise asyncio.CancelledError() from None  # Serve logs it as cancelled, not failed
        finally:
            self.calls.cancel()
