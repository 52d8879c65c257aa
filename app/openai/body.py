"""Reading a request body as a JSON object, within a byte limit (413 past it)."""

from __future__ import annotations

import json

from fastapi import Request
from fastapi.responses import JSONResponse

from app.openai.responses import error_response


def _too_large(limit: int) -> JSONResponse:
    return error_response(f"The request body is larger than the server's limit of {limit} "
                          "bytes.", 413, code="request_too_large")


async def read_json_object(request: Request, limit: int) -> dict | JSONResponse:
    """The body as a dict, or the error response to send instead. Stops reading at `limit`
    bytes whether or not the client declared a Content-Length."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        return _too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            return _too_large(limit)
        chunks.append(chunk)
    try:
        # bytes: json detects UTF-8/16/32 and raises UnicodeDecodeError on invalid sequences
        body = json.loads(b"".join(chunks))
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        return error_response(f"Invalid JSON in the request body: {e}", 400)
    if not isinstance(body, dict):
        return error_response("The request body must be a JSON object.", 400)
    return body
