"""The app's OpenAPI schema, with the request bodies the routes parse by hand.

The POST routes read the raw body themselves (a byte limit, JSON errors in OpenAI's shape), so
FastAPI cannot see their pydantic models; this puts those models in /openapi.json, which is what
clients' generators and the schemathesis fuzz tests read.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

_REF = "#/components/schemas/{model}"
_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "integer", "null"]},
            },
        }
    },
}
_ERROR_STATUSES = {
    "400": "Invalid request",
    "401": "Missing or wrong API key",
    "404": "Unknown model",
    "413": "Request body too large",
    "415": "Request body not declared as JSON",
    "429": "Too many requests waiting",
    "503": "Pipeline unavailable",
}


def document_request_bodies(app: FastAPI, bodies: dict[str, type[BaseModel]]) -> None:
    """Make `app.openapi()` describe each POST path's JSON body with its model."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        components["Error"] = _ERROR
        for path, model in bodies.items():
            body = model.model_json_schema(ref_template=_REF)
            components.update(body.pop("$defs", {}))
            components[model.__name__] = body
            op = schema["paths"][path]["post"]
            op["requestBody"] = {
                "required": True,
                "content": {
                    "application/json": {"schema": {"$ref": _REF.format(model=model.__name__)}}
                },
            }
            error = {
                "content": {"application/json": {"schema": {"$ref": _REF.format(model="Error")}}}
            }
            op["responses"].update(
                {code: {"description": text, **error} for code, text in _ERROR_STATUSES.items()}
            )
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI documents replacing it
