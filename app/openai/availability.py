"""Whether the ingress can reach a PipelineServer replica at all.

A DeploymentHandle queues a call while its deployment has no running replica (one died and
Serve is starting its replacement, which takes as long as building a pipeline), so a client
would wait without a word. The ingress gives a call a short while, then asks Serve's status:
with no replica running it answers 503 at once; otherwise (replicas busy) the call keeps
waiting its turn.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from ray import serve

# How long a call may wait before the ingress looks at the replicas (a live replica answers
# a call's first message in milliseconds).
FIRST_REPLY_S = 1.0
STATUS_MAX_AGE_S = 1.0  # one status query a second, however many calls wait


class Unavailable(Exception):
    """No replica of the deployment is running."""


class ReplicaWatch:
    def __init__(self, deployment: str):
        self.deployment = deployment
        self._app: str | None = None
        self._checked = 0.0
        self._running = True

    def _count_running(self) -> bool:
        if self._app is None:
            self._app = serve.get_replica_context().app_name
        app = serve.status().applications.get(self._app)
        dep = app.deployments.get(self.deployment) if app else None
        # Scaled to zero: the call itself is what brings a replica up, so it waits.
        # replica_states is keyed by ReplicaState, a str enum: its name looks it up.
        return (
            dep is None
            or dep.replica_states.get("RUNNING", 0) > 0  # type: ignore[call-overload]
            or dep.status == "UPSCALING"
        )

    async def running(self) -> bool:
        now = time.monotonic()
        if now - self._checked >= STATUS_MAX_AGE_S:
            self._checked = now
            self._running = await asyncio.to_thread(self._count_running)
        return self._running

    async def first(self, call: Awaitable[Any], cancel: Callable[[], object]) -> Any:
        """`call`'s result; raises Unavailable (after `cancel()`) when no replica runs."""
        fut = asyncio.ensure_future(call)
        try:
            while True:
                done, _ = await asyncio.wait({fut}, timeout=FIRST_REPLY_S)
                if done:
                    return fut.result()
                if not await self.running():
                    raise Unavailable(f"no {self.deployment} replica is running")
        except BaseException:  # also the caller's cancellation: the call must not run on
            fut.cancel()
            fut.add_done_callback(_retrieve)  # whatever it ends with is nobody's to log
            cancel()
            raise


def _retrieve(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()
