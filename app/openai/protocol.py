"""OpenAI request schemas (pydantic) and their mapping to SamplingParams.

Field names and defaults follow OpenAI, plus vLLM's extra sampling fields (top_k, min_p,
repetition_penalty, min_tokens, ignore_eos, stop_token_ids, ...). Unknown fields are ignored, as
OpenAI clients send newer ones freely. Types are strict (OpenAI refuses "max_tokens": "5" and
"stream": 1 too) and numbers finite: a NaN temperature must never reach a sampler. Value ranges
live in SamplingParams.validate, the one place the engine's own callers go through as well.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Annotated, Any, Literal, Union, cast

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
)
from pydantic.config import JsonDict

from app.openai.structured_fields import StructuredFields
from app.openai.tools import ToolFields
from app.request import InvalidRequest, SamplingParams, StructuredOutput


def _utf8(text: str) -> str:
    # JSON may spell lone surrogates ("\ud800"): valid JSON, but no UTF-8 text to tokenize.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"not valid UTF-8 text ({e.reason} at {e.start})") from None
    return text


Text = Annotated[str, AfterValidator(_utf8)]
TokenIds = list[int]
# Strict types, finite numbers; unknown fields ignored.
STRICT = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


# Choices of one request (prompts x n): each is a request of its own in the pipeline.
MAX_CHOICES = 128

_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def describe_error(e: ValidationError) -> tuple[str, str | None]:
    """OpenAI-style message and `param` (a dotted field path, without list indexes or the
    type tags pydantic adds inside unions) for the first error."""
    err = e.errors()[0]
    path = [x for x in err.get("loc", ()) if isinstance(x, str)]
    fields = path[:1] + [x for x in path[1:] if x.isidentifier() and x not in _TYPE_TAGS]
    loc = ".".join(fields) or None
    if err.get("type") == "missing":
        return f"Missing required field '{loc}'.", loc
    return f"Invalid value for '{loc}': {err.get('msg')}.", loc


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(StructuredFields):
    model_config = STRICT

    model: Text | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Union[Text, list[Text], None] = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, object] | None = None  # checked by SamplingParams, key by key
    user: Text | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    allowed_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None
    bad_words: list[Text] | None = None
    priority: int = 0

    def _check_common(self) -> None:
        if not 1 <= self.n <= MAX_CHOICES:
            raise InvalidRequest(f"n must be between 1 and {MAX_CHOICES}, got {self.n}.", param="n")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest(
                "stream_options is only allowed when stream is true.", param="stream_options"
            )

    def _params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """The fields SamplingParams shares with this schema, None meaning its default."""
        given = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(SamplingParams)
            if getattr(self, f.name, None) is not None
        }
        given["structured"] = self.structured_output()
        return SamplingParams(**{**given, "max_tokens": max_tokens, "logprobs": logprobs})

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage on every chunk (vLLM's `continuous_usage_stats`, with include_usage)."""
        return self.include_usage and bool(
            self.stream_options and self.stream_options.continuous_usage_stats
        )

    def prompt_fields(self) -> dict[str, Any]:
        raise NotImplementedError

    def prompts_fields(self) -> list[dict[str, Any]]:
        """The GenerateRequest fields of each prompt: one PipelineServer call each."""
        return [self.prompt_fields()]


class CompletionRequest(_Sampling):
    prompt: Union[Text, TokenIds, list[Text], list[TokenIds]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = False
    suffix: Text | None = None
    best_of: int | None = None

    def prompts(self) -> list[str | list[int]]:
        """One prompt, or a batch: a list of strings or of token-id lists."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            return list(p)
        # One prompt (an empty one is refused with the others: Coordinator.add_request)
        return [cast(Union[Text, TokenIds], p)]

    def prompt_fields(self) -> dict[str, Any]:
        return self.prompts_fields()[0]

    def prompts_fields(self) -> list[dict[str, Any]]:
        prompts = self.prompts()
        if len(prompts) * self.n > MAX_CHOICES:
            raise InvalidRequest(
                f"{len(prompts)} prompts x n={self.n} choices is more than "
                f"{MAX_CHOICES} choices in one request.",
                param="prompt",
            )
        return [{"prompt": p, "echo": self.echo} for p in prompts]

    def sampling_params(self) -> SamplingParams:
        self._check_common()
        if self.suffix:
            raise InvalidRequest("suffix is not supported.", param="suffix")
        if self.best_of not in (None, self.n):
            raise InvalidRequest(
                "best_of must equal n (best_of > n is not supported).", param="best_of"
            )
        params = self._params(self.max_tokens, self.logprobs)
        if self.echo and self.logprobs is not None:  # the echoed prompt comes with logprobs
            k = max(self.logprobs, params.prompt_logprobs or 0)
            params = dataclasses.replace(params, prompt_logprobs=k)
        return params


class ContentPart(BaseModel):
    model_config = STRICT
    type: Text = "text"
    text: Text = ""


class MessageFunction(BaseModel):
    model_config = STRICT
    name: Text
    arguments: Text  # JSON text, as OpenAI sends it back


class MessageToolCall(BaseModel):
    model_config = STRICT
    id: Text
    type: Literal["function"] = "function"
    function: MessageFunction


# The rule of ChatMessage._has_content, stated in its JSON schema (GET /openapi.json).
_CONTENT_OR_TOOL_CALLS: JsonDict = {
    "anyOf": [
        {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}},
        {
            "required": ["role", "tool_calls"],
            "properties": {"role": {"const": "assistant"}, "tool_calls": {"minItems": 1}},
        },
    ]
}


class ChatMessage(BaseModel):
    model_config = ConfigDict(**STRICT, json_schema_extra=_CONTENT_OR_TOOL_CALLS)
    # Any role, as vLLM takes: the chat template decides (one that raises on it is a 400)
    role: Text
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: Text | None = None
    name: Text | None = None
    # Only an assistant message that calls tools may come without content (checked after
    # the fields above, which it reads).
    content: Union[Text, list[ContentPart], None] = Field(default=None, validate_default=True)

    @field_validator("content")
    @classmethod
    def _has_content(
        cls, content: Union[Text, list[ContentPart], None], info: ValidationInfo
    ) -> Union[Text, list[ContentPart], None]:
        if content is None and not (
            info.data.get("role") == "assistant" and info.data.get("tool_calls")
        ):
            raise ValueError("content is required (except in an assistant's tool calls)")
        return content

    def as_dict(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            if any(p.type != "text" for p in content):
                raise InvalidRequest("only text content parts are supported.", param="messages")
            content = "".join(p.text for p in content)
        out: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.tool_calls:
            out["tool_calls"] = [_template_call(c) for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


def _template_call(call: MessageToolCall) -> dict[str, Any]:
    """A tool call as chat templates take it: arguments as a mapping where they are JSON."""
    try:
        args = json.loads(call.function.arguments)
    except ValueError:
        args = call.function.arguments
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.function.name, "arguments": args},
    }


# apply_chat_template's own parameters and the template's `messages`: not template variables
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
     "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation",
     "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
     "tokenizer_kwargs"}
)  # fmt: skip


class ChatTemplateFields(BaseModel):
    """How the chat template renders the messages (vLLM's fields): a new assistant turn opened
    (add_generation_prompt), or the last message left open for the model to go on with
    (continue_final_message: a prefilled answer); chat_template_kwargs as the template's
    variables (Qwen3's enable_thinking, ...)."""

    model_config = STRICT
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    def template_fields(self) -> dict[str, Any]:
        if self.continue_final_message and self.add_generation_prompt:
            raise InvalidRequest(
                "continue_final_message needs add_generation_prompt=false.",
                param="continue_final_message",
            )
        reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(self.chat_template_kwargs or ()))
        if reserved:
            raise InvalidRequest(
                f"chat_template_kwargs may not set {reserved[0]!r} (a request field or the "
                "renderer's own).",
                param="chat_template_kwargs",
            )
        return {
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
            "template_kwargs": self.chat_template_kwargs or None,
        }


class ChatCompletionRequest(_Sampling, ToolFields, ChatTemplateFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def structured_output(self) -> StructuredOutput | None:
        """response_format / guided_*, or the grammar of a tool_choice that forces a call."""
        stated, forced = super().structured_output(), self.tool_grammar()
        if stated is not None and forced is not None:
            raise InvalidRequest(
                "a tool_choice that forces a call cannot be combined with "
                "another output constraint.",
                param="tool_choice",
            )
        return forced or stated

    def sampling_params(self) -> SamplingParams:
        self._check_common()
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs=true.", param="top_logprobs")
        max_tokens = (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )
        return self._params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None)

    def prompt_fields(self) -> dict[str, Any]:
        """The GenerateRequest fields of this request's prompt."""
        fields = {"messages": [m.as_dict() for m in self.messages], **self.template_fields()}
        if self.tools:
            fields["tools"] = self.template_tools()
        return fields
