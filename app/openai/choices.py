"""The choices of one OpenAI request (n per prompt, one or more prompts), built from their
deltas into one body or into SSE chunks, with exact usage.

Usage counts each prompt once and every choice's generated tokens; with
`stream_options.continuous_usage_stats` every chunk of choice i also carries the usage of that
choice so far (its prompt, its tokens), as vLLM's does.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi.responses import JSONResponse

from app.messages import Accepted, Delta, Failure
from app.openai.calls import PipelineCalls
from app.openai.chat_output import ChatOutput
from app.openai.responses import (
    SSE_DONE,
    ResponseBuilder,
    chat_logprobs,
    completion_logprobs,
    error_body,
    error_response,
    sse,
    usage,
    vllm_prompt_logprobs,
)
from app.request import RequestOutput, TokenLogprob


class _Choice:
    def __init__(self, prompt: int, echo_text: str | None):
        self.prompt = prompt  # which prompt of the request
        self.echo = echo_text is not None  # completions' echo: the prompt comes first
        self.unsent_echo = echo_text or ""  # streamed with the choice's first token
        self.offset = 0  # text_offset of the next logprob: the length of the tokens before it
        self.text = [echo_text or ""]
        self.logprobs: dict[str, Any] | None = None
        self.finish_reason: str | None = None
        self.completion_tokens = 0
        self.chat_output: ChatOutput | None = None  # tool calls / reasoning to split off
        # vLLM's prompt_logprobs, when asked
        self.prompt_logprobs: list[dict[str, Any] | None] | None = None


class Choices:
    def __init__(
        self,
        builder: ResponseBuilder,
        accepted: list[Accepted],
        n: int,
        include_usage: bool = False,
        continuous_usage: bool = False,
        prompt_logprobs: bool = False,
    ):
        self.b = builder
        # The client asked for vLLM's prompt_logprobs (echo with logprobs computes them too,
        # and a stream then carries them as the prompt's logprobs only)
        self.prompt_logprobs = prompt_logprobs
        self.prompt_tokens = [a.prompt_tokens for a in accepted]
        self.choices = [_Choice(p, a.echo_text) for p, a in enumerate(accepted) for _ in range(n)]
        self.include_usage = include_usage
        self.continuous_usage = include_usage and continuous_usage

    def take(self, index: int, delta: Delta) -> tuple[_Choice, dict[str, Any] | None]:
        """Account one delta of choice `index`; its logprobs in the endpoint's shape."""
        c, out = self.choices[index], delta.out
        c.completion_tokens = out.completion_tokens
        self.prompt_tokens[c.prompt] = out.prompt_tokens or self.prompt_tokens[c.prompt]
        if out.finished:
            c.finish_reason = out.finish_reason
        if out.prompt_logprobs is not None:
            c.prompt_logprobs = vllm_prompt_logprobs(out.prompt_logprobs, delta.pieces)
        return c, self._logprobs(c, out, delta.pieces)

    def _logprobs(
        self, c: _Choice, out: RequestOutput, pieces: dict[int, str]
    ) -> dict[str, Any] | None:
        if out.logprobs is None:
            return None
        if self.b.chat:
            return chat_logprobs(out.logprobs, pieces)
        ids: list[int] = [t.token_id for t in out.logprobs]
        lps: list[TokenLogprob | None] = list(out.logprobs)
        # echo: the prompt's logprobs come first, with the first token's (the same chunk)
        if c.echo and out.prompt_logprobs is not None and out.prompt_token_ids is not None:
            ids, lps = out.prompt_token_ids + ids, out.prompt_logprobs + lps
        lp = completion_logprobs(ids, lps, pieces, c.offset)
        c.offset += sum(len(t) for t in lp["tokens"])
        return lp

    def add_prompt_logprobs(self, body: dict[str, Any], index: int, c: _Choice) -> dict[str, Any]:
        """vLLM's `prompt_logprobs`: on the choice (completions) or the body (chat)."""
        if c.prompt_logprobs is not None:
            choice = next(x for x in body["choices"] if x["index"] == index)
            (body if self.b.chat else choice)["prompt_logprobs"] = c.prompt_logprobs
        return body

    def usage(self) -> dict[str, Any]:
        return usage(sum(self.prompt_tokens), sum(c.completion_tokens for c in self.choices))

    def choice_usage(self, c: _Choice) -> dict[str, Any] | None:
        """The chunk usage of choice `c` so far, with continuous usage stats (else None)."""
        if not self.continuous_usage:
            return None
        return usage(self.prompt_tokens[c.prompt], c.completion_tokens)


async def collect(calls: PipelineCalls, choices: Choices) -> JSONResponse:
    """The whole body (not streamed)."""
    async with aclosing(calls.replies()) as replies:
        async for index, reply in replies:
            if isinstance(reply, Failure):
                return error_response(reply.message, reply.status, reply.param)
            c, lp = choices.take(index, reply)
            c.text.append(reply.out.text)
            if lp is not None:
                c.logprobs = lp if c.logprobs is None else {k: c.logprobs[k] + lp[k] for k in lp}
    b = choices.b
    body = b.full(
        [
            b.choice(i, "".join(c.text), c.logprobs, c.finish_reason)
            for i, c in enumerate(choices.choices)
        ],
        choices.usage(),
    )
    for i, c in enumerate(choices.choices):
        choices.add_prompt_logprobs(body, i, c)
        if c.chat_output is not None:
            choice = body["choices"][i]
            choice["message"].update(c.chat_output.message("".join(c.text)))
            choice["finish_reason"] = c.chat_output.finish_reason(c.finish_reason)
    return JSONResponse(body)


def _chat_chunks(
    choices: Choices, index: int, c: _Choice, out: RequestOutput, lp: dict[str, Any] | None
) -> list[str]:
    """A chat delta split into content, reasoning_content and tool_calls."""
    co = c.chat_output
    if co is None:
        return []
    fields = co.delta(out.text, out.finished)
    reason = co.finish_reason(out.finish_reason) if out.finished else None
    if not (fields or reason or lp is not None):
        return []
    chunk = choices.b.chunk("", lp, reason, index=index, usage_=choices.choice_usage(c))
    chunk["choices"][0]["delta"] = fields
    return [sse(chunk)]


async def stream(calls: PipelineCalls, choices: Choices) -> AsyncIterator[str]:
    """SSE frames: each chat choice opens with its role, each echoing completion with its
    prompt and first token (as vLLM and SGLang send them: one chunk whose logprobs, when
    asked, cover both); the usage chunk (include_usage) comes last, before [DONE]."""
    b = choices.b
    if b.chat:
        for i, c in enumerate(choices.choices):
            yield sse(b.chunk("", None, None, first=True, index=i, usage_=choices.choice_usage(c)))
    async with aclosing(calls.replies()) as replies:
        async for index, reply in replies:
            if isinstance(reply, Failure):
                yield sse(error_body(reply.message, reply.status, reply.param))
                break
            c, lp = choices.take(index, reply)
            out = reply.out
            if out.prompt_logprobs is not None and choices.prompt_logprobs:
                chunk = b.chunk("", None, None, index=index)  # the first delta: its own chunk
                yield sse(choices.add_prompt_logprobs(chunk, index, c))
            text, c.unsent_echo = c.unsent_echo + out.text, ""
            if c.chat_output is not None:
                for frame in _chat_chunks(choices, index, c, out, lp):
                    yield frame
            elif text or out.finished or lp is not None:
                yield sse(
                    b.chunk(
                        text,
                        lp,
                        out.finish_reason if out.finished else None,
                        index=index,
                        usage_=choices.choice_usage(c),
                    )
                )
    if choices.include_usage:
        yield sse(b.usage_chunk(choices.usage()))
    yield SSE_DONE
