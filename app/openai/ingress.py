"""The OpenAI ingress: parses and validates, checks the API key, stamps the arrival time, and
streams a PipelineServer's deltas back as OpenAI bodies or SSE. It owns no model state."""

# No `from __future__ import annotations` here: FastAPI must see the real Request type on the
# class-based routes that serve.ingress rewrites.

import asyncio
import hmac
import time
import uuid
from typing import Any, TypeVar, Union

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from ray import serve
from ray.exceptions import TaskCancelledError

from app.messages import PIPELINE_UNAVAILABLE, Failure, GenerateRequest
from app.openai.availability import ReplicaWatch
from app.openai.body import read_json_object
from app.openai.calls import CallsStream, PipelineCalls
from app.openai.chat_output import ChatOutput
from app.openai.choices import Choices, collect
from app.openai.choices import stream as stream_choices
from app.openai.openapi import document_request_bodies
from app.openai.protocol import ChatCompletionRequest, CompletionRequest, describe_error
from app.openai.responses import ResponseBuilder, error_response, health_response
from app.openai.tokenize import DetokenizeRequest, TokenizeRequest
from app.prefix_routing import prompt_key
from app.request import InvalidRequest

Body = TypeVar("Body", bound=BaseModel)


def make_ingress(
    model_name: str,
    api_key: str | None,
    max_request_bytes: int,
    routing_block_size: int | None = None,
    allowed_origins: tuple[str, ...] = (),
) -> type[Any]:
    """The ingress deployment class; FastAPI routes need an app object, built here per call.
    routing_block_size: with prefix-aware routing, the block size of its keys. Browsers get
    CORS headers only for `allowed_origins` (none by default)."""
    fastapi_app = FastAPI(title="ppserve", docs_url=None, redoc_url=None)
    if allowed_origins:
        fastapi_app.add_middleware(
            CORSMiddleware,
            allow_origins=list(allowed_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type"],
        )
    document_request_bodies(
        fastapi_app,
        {
            "/v1/completions": CompletionRequest,
            "/v1/chat/completions": ChatCompletionRequest,
            "/tokenize": TokenizeRequest,
            "/detokenize": DetokenizeRequest,
        },
    )

    @serve.ingress(fastapi_app)
    class OpenAIIngress:
        def __init__(self, server: Any) -> None:
            self.server = server  # DeploymentHandle of the PipelineServer
            self.replicas = ReplicaWatch(server.deployment_name)
            self.model = model_name
            self._info: dict[str, Any] | None = None

        def _auth(self, request: Request) -> JSONResponse | None:
            if not api_key:
                return None
            given = request.headers.get("authorization", "")
            token = given[7:] if given.lower().startswith("bearer ") else ""
            if hmac.compare_digest(token.encode(), api_key.encode()):
                return None
            return error_response("Incorrect or missing API key.", 401, code="invalid_api_key")

        @fastapi_app.get("/health")
        async def health(self) -> Response:
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
        async def models(self, request: Request) -> Response:
            if (denied := self._auth(request)) is not None:
                return denied
            if self._info is None:
                self._info = await self.server.info.remote()
            card = {
                "id": self.model,
                "object": "model",
                "created": int(time.time()),
                "owned_by": "ppserve",
                "root": self._info.get("root") or self.model,
                "max_model_len": self._info["max_model_len"],
            }
            return JSONResponse({"object": "list", "data": [card]})

        @fastapi_app.post("/v1/completions")
        async def completions(self, request: Request) -> Response:
            return await self._serve(request, CompletionRequest, "completion")

        @fastapi_app.post("/v1/chat/completions")
        async def chat_completions(self, request: Request) -> Response:
            return await self._serve(request, ChatCompletionRequest, "chat")

        @fastapi_app.post("/tokenize")
        async def tokenize(self, request: Request) -> Response:
            """vLLM's: {count, max_model_len, tokens, token_strs} of a prompt or a chat."""
            req = await self._read(request, TokenizeRequest)
            if isinstance(req, Response):
                return req
            try:
                call = self.server.tokenize.remote(req.message())
            except InvalidRequest as e:
                return error_response(str(e), e.status, e.param)
            out = await self._call(call)
            if isinstance(out, Failure):
                return error_response(out.message, out.status, out.param)
            return JSONResponse(
                {
                    "count": len(out.tokens),
                    "max_model_len": out.max_model_len,
                    "tokens": out.tokens,
                    "token_strs": out.token_strs,
                }
            )

        @fastapi_app.post("/detokenize")
        async def detokenize(self, request: Request) -> Response:
            """vLLM's: {prompt} from token ids."""
            req = await self._read(request, DetokenizeRequest)
            if isinstance(req, Response):
                return req
            out = await self._call(self.server.detokenize.remote(req.tokens))
            if isinstance(out, Failure):
                return error_response(out.message, out.status, out.param)
            return JSONResponse({"prompt": out})

        async def _call(self, call: Any) -> Any:
            """A short call's result, or a Failure when no replica can answer it."""
            try:
                return await self.replicas.first(call, call.cancel)
            except Exception as e:
                return Failure.internal(PIPELINE_UNAVAILABLE, e)

        async def _read(self, request: Request, schema: type[Body]) -> Union[Body, Response]:
            """The body as `schema`, or the error to answer: the API key, the body's size and
            JSON, its fields, the model's name."""
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
            model = getattr(req, "model", None)
            if model is not None and model != self.model:
                return error_response(
                    f"The model `{model}` does not exist.", 404, "model", code="model_not_found"
                )
            return req

        async def _serve(
            self,
            request: Request,
            schema: Union[type[CompletionRequest], type[ChatCompletionRequest]],
            kind: str,
        ) -> Response:
            arrival = time.time()  # TTFT counts from here (wall clock: crosses processes)
            req = await self._read(request, schema)
            if isinstance(req, Response):
                return req
            prefix = "chatcmpl" if kind == "chat" else "cmpl"
            request_id = f"{prefix}-{uuid.uuid4().hex}"
            try:
                params = req.sampling_params()
                gen_reqs = []
                for p, fields in enumerate(fields_list := req.prompts_fields()):
                    if routing_block_size:
                        fields["prefix_key"] = prompt_key(
                            fields.get("prompt"), fields.get("messages"), routing_block_size
                        )
                    gen_reqs.append(
                        GenerateRequest(
                            request_id=request_id
                            if len(fields_list) == 1
                            else f"{request_id}-p{p}",
                            params=params,
                            arrival_time=arrival,
                            n=req.n,
                            **fields,
                        )
                    )
            except InvalidRequest as e:
                return error_response(str(e), e.status, e.param)
            calls = PipelineCalls(self.server, self.replicas, gen_reqs)
            streaming = False
            try:  # the requests are queued, or refused
                accepted = await calls.accept()
                if isinstance(accepted, Failure):
                    return error_response(accepted.message, accepted.status, accepted.param)
                choices = Choices(
                    ResponseBuilder(kind, request_id, self.model),
                    accepted,
                    req.n,
                    req.include_usage,
                    req.continuous_usage,
                    prompt_logprobs=req.prompt_logprobs is not None,
                )
                if kind == "chat":  # tool calls / reasoning to split off, choice by choice
                    for c in choices.choices:
                        c.chat_output = ChatOutput.for_request(req, accepted[c.prompt])
                if req.stream:
                    streaming = True  # from here the response cancels the calls
                    return CallsStream(stream_choices(calls, choices), calls)
                return await collect(calls, choices)
            except TaskCancelledError:  # Serve cancelled our calls: the client is gone
                raise asyncio.CancelledError() from None
            finally:
                if not streaming:
                    calls.cancel()

    return OpenAIIngress
