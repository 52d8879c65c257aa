"""Reading a request body as a JSON object, within a byte limit (413 past it)."""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from ray.exceptions import TaskCancelledError
from starlette.requests import ClientDisconnect

from app.openai.responses import error_response


def _too_large(limit: int) -> JSONResponse:
    return error_response(
        f"The request body is larger than the server's limit of {limit} bytes.",
        413,
        code="request_too_large",
    )


# What a client that went away while sending its body is answered (nginx's convention; nobody
# reads it, and it is no server error to log).
CLIENT_CLOSED = 499


def _is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (
        media.startswith("application/") and media.endswith("+json")
    )


async def read_json_object(request: Request, limit: int) -> dict[str, Any] | Response:
    """The body as a dict, or the response to send instead. Stops reading at `limit` bytes
    whether or not the client declared a Content-Length. A body declared as anything but
    JSON is a 415 (no Content-Type at all is read as JSON, as FastAPI does)."""
    content_type = request.headers.get("content-type")
    if content_type is not None and not _is_json(content_type):
        return error_response(
            f"Unsupported Content-Type {content_type!r}: the body must be JSON (application/json).",
            415,
            code="unsupported_media_type",
        )
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        return _too_large(limit)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                return _too_large(limit)
            chunks.append(chunk)
    except (ClientDisconnect, TaskCancelledError):  # Serve cancelled the receive: gone too
        return Response(status_code=CLIENT_CLOSED)
    try:
        # bytes: json detects UTF-8/16/32 and raises UnicodeDecodeError on invalid sequences
        body = json.loads(b"".join(chunks))
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        return error_response(f"Invalid JSON in the request body: {e}", 400)
    if not isinstance(body, dict):
        return error_response("The request body must be a JSON object.", 400)
    return body
