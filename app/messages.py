"""The typed messages between the OpenAI ingress and a PipelineServer replica (pure Python).

The ingress sends one GenerateRequest; the server streams back Accepted (the request is
queued) or a Failure, then Delta after Delta, and a Failure if the request fails later. A
Failure is the one way an error travels, whenever it happens. /tokenize sends a Tokenize and
gets Tokenized or a Failure back.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from app.prefix_routing import PrefixKey
from app.request import InvalidRequest, RequestOutput, SamplingParams


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    params: SamplingParams
    arrival_time: float  # the ingress's wall clock: TTFT counts from here
    prompt: str | list[int] | None = None  # completions
    messages: list[dict[str, str]] | None = None  # chat: rendered by the server's chat template
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # chat: the last message left open (a prefill)
    template_kwargs: dict[str, Any] | None = None  # chat: the template's own variables
    echo: bool = False
    tools: list[dict[str, Any]] | None = None  # chat: OpenAI's tool definitions, for the template
    prefix_key: PrefixKey | None = None  # for the router (app/prefix_router.py), when it routes
    n: int = 1  # choices sampled from this prompt, their KV shared (PipelineServer.generate)


@dataclass(frozen=True)
class Tokenize:
    """/tokenize: a prompt, or chat messages rendered by the server's chat template."""

    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True  # a prompt's, as a completion tokenizes it
    return_token_strs: bool = False


@dataclass(frozen=True)
class Tokenized:
    tokens: list[int]
    max_model_len: int
    token_strs: list[str] | None = None  # the tokenizer's own spelling of each token


@dataclass(frozen=True)
class Accepted:
    echo_text: str | None = None  # the prompt as text, when echo was asked
    tool_format: str | None = None  # chat: how this model writes tool calls (app/tool_parsers)
    # chat: None when the template marks no reasoning; else whether the prompt opened <think>
    thinking: bool | None = None
    prompt_tokens: int = 0


@dataclass(frozen=True)
class Delta:
    out: RequestOutput
    pieces: dict[int, str] = field(default_factory=dict)  # token id -> text, for logprobs
    index: int = 0  # which of the request's n choices


@dataclass(frozen=True)
class Failure:
    message: str
    status: int = 500
    param: str | None = None

    @classmethod
    def of(cls, e: InvalidRequest) -> Failure:
        return cls(str(e), e.status, e.param)

    @classmethod
    def internal(cls, public: str, cause: BaseException, status: int = 503) -> Failure:
        """`public` for the client; `cause` and its traceback for the server log only."""
        logging.getLogger("ppserve.errors").error("%s", public, exc_info=cause)
        return cls(public, status)


# What a client is told when the PipelineServer replica behind the ingress is unreachable (it
# died, or Serve is replacing it): retryable, with no detail of the cluster.
PIPELINE_UNAVAILABLE = (
    "The model server is restarting or unavailable; please retry in a few seconds."
)


Reply = Accepted | Delta | Failure
