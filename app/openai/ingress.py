"""The OpenAI ingress: parses and validates, checks the API key, stamps the arrival time, and
streams a PipelineServer's deltas back as OpenAI bodies or SSE. It owns no model state."""

# No `from __future__ import annotations` here: FastAPI must see the real Request type on the
# class-based routes that serve.ingress rewrites.

import hmac
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from ray import serve

from app.messages import PIPELINE_UNAVAILABLE, Accepted, Delta, Failure, GenerateRequest
from app.openai.availability import ReplicaWatch
from app.openai.body import read_json_object
from app.openai.chat_output import ChatOutput
from app.openai.openapi import document_request_bodies
from app.openai.protocol import ChatCompletionRequest, CompletionRequest, describe_error
from app.openai.responses import (
    SSE_DONE,
    ResponseBuilder,
    chat_logprobs,
    completion_logprobs,
    echoed_prompt_logprobs,
    error_body,
    error_response,
    health_response,
    sse,
    usage,
    vllm_prompt_logprobs,
)
from app.prefix_routing import prompt_key
from app.request import InvalidRequest


class _Stream:
    """One request's deltas, merged for a whole body or framed chunk by chunk."""

    def __init__(self, builder: ResponseBuilder, accepted: Accepted, include_usage: bool):
        self.b = builder
        self.echo_text = accepted.echo_text or ""
        self.include_usage = include_usage
        self.prompt_tokens = 0  # from the deltas
        self.completion_tokens = 0
        self.offset = len(self.echo_text)
        self.chat_output: ChatOutput | None = None  # tool calls / reasoning to split off

    def logprobs(self, out, pieces):
        if out.logprobs is None:
            return None
        if self.b.chat:
            return chat_logprobs(out.logprobs, pieces)
        lp = completion_logprobs(out.logprobs, pieces, self.offset)
        self.offset += sum(len(t) for t in lp["tokens"])
        if self.echo_text and out.prompt_logprobs is not None:  # echo: the prompt's first
            prompt = echoed_prompt_logprobs(out.prompt_token_ids, out.prompt_logprobs, pieces)
            lp = _merge_logprobs(prompt, lp)
        return lp

    def add_prompt_logprobs(self, body: dict, out, pieces) -> dict:
        """vLLM's `prompt_logprobs` on the body or chunk that carries the first delta."""
        if out.prompt_logprobs is not None:
            where = body if self.b.chat else body["choices"][0]
            where["prompt_logprobs"] = vllm_prompt_logprobs(out.prompt_logprobs, pieces)
        return body

    def usage(self) -> dict:
        return usage(self.prompt_tokens, self.completion_tokens)


def make_ingress(model_name: str, api_key: str | None, max_request_bytes: int,
                 routing_block_size: int | None = None,
                 allowed_origins: tuple[str, ...] = ()):
    """The ingress deployment class; FastAPI routes need an app object, built here per call.
    routing_block_size: with prefix-aware routing, the block size of its keys. Browsers get
    CORS headers only for `allowed_origins` (none by default)."""
    fastapi_app = FastAPI(title="ppserve", docs_url=None, redoc_url=None)
    if allowed_origins:
        fastapi_app.add_middleware(
            CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type"])
    document_request_bodies(fastapi_app, {"/v1/completions": CompletionRequest,
                                          "/v1/chat/completions": ChatCompletionRequest})

    @serve.ingress(fastapi_app)
    class OpenAIIngress:
        def __init__(self, server):
            self.server = server  # DeploymentHandle of the PipelineServer
            self.replicas = ReplicaWatch(server.deployment_name)
            self.model = model_name
            self._info: dict | None = None

        def _auth(self, request: Request) -> JSONResponse | None:
            if not api_key:
                return None
            given = request.headers.get("authorization", "")
            token = given[7:] if given.lower().startswith("bearer ") else ""
            if hmac.compare_digest(token.encode(), api_key.encode()):
                return None
            return error_response("Incorrect or missing API key.", 401, code="invalid_api_key")

        @fastapi_app.get("/health")
        async def health(self):
            """200 {"status": "ok"} when serving; 503 otherwise, so that a readiness probe
            takes the endpoint out of rotation: {"status": "degraded"} while the pipeline is
            rebuilt after a stage failure, {"status": "unavailable"} while the replica is
            down or being replaced."""
            try:
                call = self.server.health.remote()
                state = await self.replicas.first(call, call.cancel)
            except Exception as e:  # the replica is down or being replaced
                failure = Failure.internal(PIPELINE_UNAVAILABLE, e)
                return health_response("unavailable", failure.message)
            if state["status"] != "ok":
                return health_response(state["status"], state.get("message"))
            return JSONResponse({"status": "ok"})

        @fastapi_app.get("/v1/models")
        async def models(self, request: Request):
            if (denied := self._auth(request)) is not None:
                return denied
            if self._info is None:
                self._info = await self.server.info.remote()
            card = {"id": self.model, "object": "model", "created": int(time.time()),
                    "owned_by": "ppserve", "root": self._info.get("root") or self.model,
                    "max_model_len": self._info["max_model_len"]}
            return JSONResponse({"object": "list", "data": [card]})

        @fastapi_app.post("/v1/completions")
        async def completions(self, request: Request):
            return await self._serve(request, CompletionRequest, "completion")

        @fastapi_app.post("/v1/chat/completions")
        async def chat_completions(self, request: Request):
            return await self._serve(request, ChatCompletionRequest, "chat")

        async def _serve(self, request: Request, schema, kind: str):
            arrival = time.time()  # TTFT counts from here (wall clock: crosses processes)
            if (denied := self._auth(request)) is not None:
                return denied
            body = await read_json_object(request, max_request_bytes)
            if not isinstance(body, dict):
                return body  # the error
            try:
                req = schema.model_validate(body)
            except ValidationError as e:
                message, param = describe_error(e)
                return error_response(message, 400, param)
            if req.model is not None and req.model != self.model:
                return error_response(f"The model `{req.model}` does not exist.", 404,
                                      "model", code="model_not_found")
            prefix = "chatcmpl" if kind == "chat" else "cmpl"
            try:
                fields = req.prompt_fields()
                if routing_block_size:
                    fields["prefix_key"] = prompt_key(fields.get("prompt"),
                                                      fields.get("messages"), routing_block_size)
                gen_req = GenerateRequest(
                    request_id=f"{prefix}-{uuid.uuid4().hex}", params=req.sampling_params(),
                    arrival_time=arrival, **fields)
            except InvalidRequest as e:
                return error_response(str(e), e.status, e.param)
            gen = self.server.options(stream=True).generate.remote(gen_req)
            try:  # the request is queued, or refused
                first = await self.replicas.first(gen.__anext__(), gen.cancel)
            except Exception as e:  # the replica died, or is being replaced
                gen.cancel()
                first = Failure.internal(PIPELINE_UNAVAILABLE, e)
            if isinstance(first, Failure):
                return error_response(first.message, first.status, first.param)
            state = _Stream(ResponseBuilder(kind, gen_req.request_id, self.model), first,
                            req.include_usage)
            if kind == "chat":
                state.chat_output = ChatOutput.for_request(req, first)
            if req.stream:
                return StreamingResponse(_sse(gen, state), media_type="text/event-stream")
            return await _collect(gen, state)

    return OpenAIIngress


async def _replies(gen) -> AsyncIterator[Delta | Failure]:
    """The server's replies after Accepted; a replica that dies mid-request is one more
    Failure."""
    try:
        async for reply in gen:
            yield reply
    except Exception as e:
        yield Failure.internal(PIPELINE_UNAVAILABLE, e)


async def _collect(gen, state: _Stream):
    text = [state.echo_text]
    lps, finish_reason, first = None, None, None
    async for reply in _replies(gen):
        if isinstance(reply, Failure):
            return error_response(reply.message, reply.status, reply.param)
        out = reply.out
        first = first or reply
        state.prompt_tokens = out.prompt_tokens
        text.append(out.text)
        lp = state.logprobs(out, reply.pieces)
        if lp is not None:
            lps = lp if lps is None else _merge_logprobs(lps, lp)
        state.completion_tokens = out.completion_tokens
        finish_reason = out.finish_reason
    body = state.b.full("".join(text), lps, finish_reason, state.usage())
    if first is not None:
        state.add_prompt_logprobs(body, first.out, first.pieces)
    if state.chat_output is not None:
        choice = body["choices"][0]
        choice["message"].update(state.chat_output.message("".join(text)))
        choice["finish_reason"] = state.chat_output.finish_reason(finish_reason)
    return JSONResponse(body)


def _merge_logprobs(a: dict, b: dict) -> dict:
    return {k: a[k] + b[k] for k in a}


def _chat_chunks(state: _Stream, out, lp):
    """A chat delta split into content, reasoning_content and tool_calls."""
    co = state.chat_output
    fields = co.delta(out.text, out.finished)
    reason = co.finish_reason(out.finish_reason) if out.finished else None
    if fields or reason or lp is not None:
        chunk = state.b.chunk("", lp, reason)
        chunk["choices"][0]["delta"] = fields
        yield sse(chunk)


async def _sse(gen, state: _Stream):
    """SSE frames; a client that goes away cancels `gen`, which aborts the request upstream."""
    done = False
    try:
        b = state.b
        if b.chat:
            yield sse(b.chunk("", None, None, first=True))
        elif state.echo_text:
            yield sse(b.chunk(state.echo_text, None, None))
        async for reply in _replies(gen):
            if isinstance(reply, Failure):
                yield sse(error_body(reply.message, reply.status, reply.param))
                break
            out = reply.out
            state.prompt_tokens = out.prompt_tokens
            state.completion_tokens = out.completion_tokens
            lp = state.logprobs(out, reply.pieces)
            if out.prompt_logprobs is not None:  # the first delta: a chunk of its own
                yield sse(state.add_prompt_logprobs(b.chunk("", None, None), out, reply.pieces))
            if state.chat_output is not None:
                for frame in _chat_chunks(state, out, lp):
                    yield frame
            elif out.text or out.finished or lp is not None:
                yield sse(b.chunk(out.text, lp, out.finish_reason if out.finished else None))
        if state.include_usage:
            yield sse(b.usage_chunk(state.usage()))
        yield SSE_DONE
        done = True
    finally:
        if not done:
            gen.cancel()
