"""The chat request's tool fields (`tools`, `tool_choice`, `parallel_tool_calls`) and what
they ask of the engine: the tools rendered by the chat template, and for `required` or a named
function a grammar that makes the model write a valid call (vLLM's approach: the output is
then the JSON of the call, parsed as such)."""

from __future__ import annotations

import json
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from app.request import InvalidRequest, StructuredOutput

_STRICT = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)
_ANY_ARGUMENTS = {"type": "object"}


class FunctionDef(BaseModel):
    model_config = _STRICT
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(BaseModel):
    model_config = _STRICT
    type: Literal["function"] = "function"
    function: FunctionDef


class FunctionName(BaseModel):
    model_config = _STRICT
    name: str


class NamedToolChoice(BaseModel):
    model_config = _STRICT
    type: Literal["function"] = "function"
    function: FunctionName


class ToolFields(BaseModel):
    """Mixed into ChatCompletionRequest."""

    tools: list[ToolDef] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool = True

    def tool_mode(self) -> str | None:
        """None (no tools), "none", "auto", "required" or "named"."""
        if not self.tools:
            if self.tool_choice not in (None, "none"):
                raise InvalidRequest("tool_choice needs tools.", param="tool_choice")
            return None
        choice = self.tool_choice or "auto"
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in {t.function.name for t in self.tools}:
                raise InvalidRequest(
                    f"tool_choice names function {choice.function.name!r}, "
                    "which is not among the tools.",
                    param="tool_choice",
                )
            return "named"
        return choice

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as chat templates take them (OpenAI's shape, as dicts)."""
        if not self.tools:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def tool_grammar(self) -> StructuredOutput | None:
        """The constraint of tool_choice "required" (a JSON list of calls) or a named function
        (its arguments)."""
        mode = self.tool_mode()
        if mode == "named":
            name = self.tool_choice.function.name  # type: ignore[union-attr]
            fn = next(t.function for t in self.tools or () if t.function.name == name)
            return StructuredOutput("json", json.dumps(fn.parameters or _ANY_ARGUMENTS), "tools")
        if mode != "required":
            return None
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": t.function.name},
                    "parameters": t.function.parameters or _ANY_ARGUMENTS,
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for t in self.tools or ()
        ]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not self.parallel_tool_calls:
            schema["maxItems"] = 1
        return StructuredOutput("json", json.dumps(schema), "tools")
