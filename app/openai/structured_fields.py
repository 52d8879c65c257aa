"""The request fields that constrain the output: OpenAI's `response_format` and vLLM's
`guided_*` / `structured_outputs`, mapped to one StructuredOutput (app/structured.py compiles
it). A form that is not supported is refused (400), never ignored."""

from __future__ import annotations

import json
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from app.request import InvalidRequest, StructuredOutput

_STRICT = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False, populate_by_name=True)
ANY_OBJECT = '{"type": "object"}'


class JsonSchemaFormat(BaseModel):
    model_config = _STRICT
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = _STRICT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(BaseModel):
    """vLLM's `structured_outputs` field."""

    model_config = _STRICT
    json_spec: Union[dict[str, Any], str, None] = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: Union[dict[str, Any], str, None] = None


def _json_text(value: dict[str, Any] | list[str] | str) -> str:
    return value if isinstance(value, str) else json.dumps(value)


class StructuredFields(BaseModel):
    """Mixed into the request schemas."""

    response_format: ResponseFormat | None = None
    guided_json: Union[dict[str, Any], str, None] = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def structured_output(self) -> StructuredOutput | None:
        """The one constraint the request states, or None; InvalidRequest when it states
        several or one that is not supported."""
        found: list[tuple[str, StructuredOutput]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(("response_format", StructuredOutput("json", ANY_OBJECT)))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.json_schema is None:
                raise InvalidRequest(
                    "response_format of type json_schema needs json_schema.schema.",
                    param="response_format",
                )
            found.append(
                (
                    "response_format",
                    StructuredOutput("json", json.dumps(rf.json_schema.json_schema)),
                )
            )
        guided = [
            ("guided_json", "json", self.guided_json),
            ("guided_regex", "regex", self.guided_regex),
            ("guided_choice", "choice", self.guided_choice),
            ("guided_grammar", "grammar", self.guided_grammar),
        ]
        so = self.structured_outputs
        if so is not None:
            if so.structural_tag is not None:
                raise InvalidRequest(
                    "structured_outputs.structural_tag is not supported.",
                    param="structured_outputs",
                )
            guided += [
                ("structured_outputs", "json", so.json_spec),
                ("structured_outputs", "regex", so.regex),
                ("structured_outputs", "choice", so.choice),
                ("structured_outputs", "grammar", so.grammar),
                ("structured_outputs", "json", ANY_OBJECT if so.json_object else None),
            ]
        for param, kind, value in guided:
            if value is None:
                continue
            found.append((param, StructuredOutput(kind, _json_text(value), param)))
        if len(found) > 1:
            names = ", ".join(dict.fromkeys(p for p, _ in found))
            raise InvalidRequest(
                f"only one output constraint per request, got several ({names}).", param=found[1][0]
            )
        return found[0][1] if found else None
