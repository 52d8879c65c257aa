"""OpenAI response bodies, stream chunks, SSE framing and error JSON.

Bodies are built as plain dicts in OpenAI's exact shapes (what the official client parses).
"""

from __future__ import annotations

import json
import time
from itertools import accumulate
from typing import Any

from fastapi.responses import JSONResponse

from app.request import TokenLogprob

SSE_DONE = "data: [DONE]\n\n"
RETRY_AFTER_S = "1"

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_exceeded",
    503: "server_error",
    500: "server_error",
}


def error_body(
    message: str, status: int = 400, param: str | None = None, code: str | int | None = None
) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": _ERROR_TYPES.get(status, "server_error"),
            "param": param,
            "code": code if code is not None else status,
        }
    }


def error_response(
    message: str, status: int = 400, param: str | None = None, code: str | int | None = None
) -> JSONResponse:
    # Overloaded: tell clients (the openai client honours it) when to come back.
    headers = {"Retry-After": RETRY_AFTER_S} if status in (429, 503) else None
    return JSONResponse(
        error_body(message, status, param, code), status_code=status, headers=headers
    )


def health_response(status: str, message: str | None) -> JSONResponse:
    """/health when not serving: 503 (what a readiness probe reads as "not ready")."""
    return JSONResponse(
        {"status": status, "message": message},
        status_code=503,
        headers={"Retry-After": RETRY_AFTER_S},
    )


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _token_bytes(piece: str) -> list[int]:
    if piece.startswith("bytes:"):  # "bytes:\\xe2": the raw byte of a partial character
        return [int(h, 16) for h in piece[len("bytes:") :].split("\\x") if h]
    return list(piece.encode("utf-8"))


def chat_logprobs(lps: list[TokenLogprob], pieces: dict[int, str]) -> dict[str, Any]:
    """OpenAI chat shape: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}."""

    def entry(tid: int, lp: float) -> dict[str, Any]:
        piece = pieces.get(tid, "")
        return {"token": piece, "logprob": max(lp, -9999.0), "bytes": _token_bytes(piece)}

    return {
        "content": [
            {**entry(t.token_id, t.logprob), "top_logprobs": [entry(i, v) for i, v in t.top]}
            for t in lps
        ]
    }


def completion_logprobs(
    token_ids: list[int],
    lps: list[TokenLogprob | None],
    pieces: dict[int, str],
    text_offset: int,
) -> dict[str, Any]:
    """Legacy completions shape: parallel lists tokens / token_logprobs / top_logprobs /
    text_offset. Each token's offset is `text_offset` plus the length of the tokens before it;
    an echoed prompt's first token has no logprob (None)."""
    tokens = [pieces.get(t, "") for t in token_ids]
    offsets = list(accumulate((len(p) for p in tokens), initial=text_offset))[:-1]
    return {
        "tokens": tokens,
        "token_logprobs": [None if t is None else max(t.logprob, -9999.0) for t in lps],
        # logprobs 0: the sampled token's own entry (vLLM's behaviour)
        "top_logprobs": [
            None
            if t is None
            else {
                pieces.get(i, ""): max(v, -9999.0) for i, v in (t.top or [(t.token_id, t.logprob)])
            }
            for t in lps
        ],
        "text_offset": offsets,
    }


def vllm_prompt_logprobs(
    lps: list[TokenLogprob | None], pieces: dict[int, str]
) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or {token id: {logprob,
    rank, decoded_token}} holding the prompt's token and the top k."""
    out: list[dict[str, Any] | None] = []
    for t in lps:
        if t is None:
            out.append(None)
            continue
        entry = {
            str(t.token_id): {
                "logprob": max(t.logprob, -9999.0),
                "rank": t.rank,
                "decoded_token": pieces.get(t.token_id, ""),
            }
        }
        for rank, (i, v) in enumerate(t.top, start=1):
            entry.setdefault(
                str(i),
                {"logprob": max(v, -9999.0), "rank": rank, "decoded_token": pieces.get(i, "")},
            )
        out.append(entry)
    return out


class ResponseBuilder:
    """Frames one request's deltas as completion or chat bodies / chunks."""

    def __init__(self, kind: str, request_id: str, model: str):
        self.chat = kind == "chat"
        self.id = request_id
        self.model = model
        self.created = int(time.time())
        self.object = "chat.completion" if self.chat else "text_completion"

    def _envelope(
        self, choices: list[dict[str, Any]], chunk: bool, usage_: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        obj = self.object + (".chunk" if chunk and self.chat else "")
        body: dict[str, Any] = {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if usage_ is not None or not chunk:
            body["usage"] = usage_
        return body

    def chunk(
        self,
        text: str,
        logprobs: dict[str, Any] | None,
        finish_reason: str | None,
        first: bool = False,
        usage_: dict[str, Any] | None = None,
        index: int = 0,
    ) -> dict[str, Any]:
        if self.chat:
            delta = (
                {"role": "assistant", "content": text}
                if first
                else ({"content": text} if text or not finish_reason else {})
            )
            choice = {
                "index": index,
                "delta": delta,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
        else:
            choice = {
                "index": index,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
        return self._envelope([choice], chunk=True, usage_=usage_)

    def usage_chunk(self, usage_: dict[str, Any]) -> dict[str, Any]:
        return self._envelope([], chunk=True, usage_=usage_)

    def choice(
        self, index: int, text: str, logprobs: dict[str, Any] | None, finish_reason: str | None
    ) -> dict[str, Any]:
        """One choice of a whole (not streamed) body."""
        if self.chat:
            return {
                "index": index,
                "message": {"role": "assistant", "content": text},
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def full(self, choices: list[dict[str, Any]], usage_: dict[str, Any]) -> dict[str, Any]:
        return self._envelope(choices, chunk=False, usage_=usage_)
