"""Concurrent loopback clients for the overload and soak tests: one request, streamed or not,
read to its end, with what a test needs to compare it against the same request run alone."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import httpx


@dataclass
class Reply:
    status: int
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int | None = None
    done: bool = False  # a stream ended with [DONE] (a whole body counts as done)
    retry_after: str | None = None
    error: dict | None = None


async def complete(client: httpx.AsyncClient, body: dict) -> Reply:
    """POST /v1/completions and read the whole answer (SSE frames when body["stream"])."""
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200 or not body.get("stream"):
            raw = await r.aread()
            data = json.loads(raw)
            if r.status_code != 200:
                return Reply(r.status_code, retry_after=r.headers.get("retry-after"),
                             error=data.get("error"))
            choice = data["choices"][0]
            return Reply(200, choice["text"], choice["finish_reason"],
                         data["usage"]["completion_tokens"], done=True)
        reply = Reply(200)
        async for line in r.aiter_lines():
            if not line:
                continue
            payload = line.removeprefix("data: ")
            if payload == "[DONE]":
                reply.done = True
                break
            chunk = json.loads(payload)
            if "error" in chunk:
                reply.error = chunk["error"]
                continue
            if chunk.get("usage"):
                reply.completion_tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk["choices"]:
                reply.text += choice["text"]
                reply.finish_reason = choice["finish_reason"] or reply.finish_reason
        return reply


async def flood(base_url: str, bodies: list[dict], concurrency: int | None = None) -> list[Reply]:
    """Send every body at once (or `concurrency` at a time) over loopback; replies in order."""
    limit = concurrency or len(bodies)
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    gate = asyncio.Semaphore(limit)
    async with httpx.AsyncClient(base_url=base_url, timeout=1800, limits=limits) as client:
        async def one(body):
            async with gate:
                return await complete(client, body)

        return list(await asyncio.gather(*(one(b) for b in bodies)))


async def sequential(base_url: str, bodies: list[dict]) -> list[Reply]:
    async with httpx.AsyncClient(base_url=base_url, timeout=1800) as client:
        return [await complete(client, b) for b in bodies]
