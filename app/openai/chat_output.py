"""One chat choice's text as OpenAI's message fields: `content`, `reasoning_content` and
`tool_calls`, for a whole body or delta by delta (app/tool_parsers.py splits the text).

With tool_choice "required" or a named function the grammar made the whole output the JSON
of the call(s): it is parsed once complete. Under "auto" the model's own format is parsed."""

from __future__ import annotations

import json
import uuid
from typing import Any

from app.tool_parsers import ChatOutputParser, Parsed, ReasoningParser, ToolCall


class ChatOutput:
    def __init__(
        self,
        tool_mode: str | None,
        tool_format: str | None,
        thinking: bool | None,
        named: str | None = None,
    ) -> None:
        self.mode = tool_mode
        self.named = named
        reasoning = ReasoningParser(inside=thinking) if thinking is not None else None
        auto = tool_format if tool_mode == "auto" else None
        self._parser = ChatOutputParser(auto, reasoning)
        self._forced = tool_mode in ("required", "named")
        self._forced_text = ""
        self.calls: list[ToolCall] = []

    @classmethod
    def for_request(cls, req: Any, accepted: Any) -> ChatOutput | None:
        """None where the text is plain content (no tools to parse, no reasoning marked)."""
        mode = req.tool_mode()
        if mode in (None, "none") and accepted.thinking is None:
            return None
        named = req.tool_choice.function.name if mode == "named" else None
        return cls(mode, accepted.tool_format, accepted.thinking, named)

    def _forced_calls(self, text: str) -> Parsed:
        try:
            value = json.loads(text)
        except ValueError:  # cut by max_tokens: what there is, as content
            return Parsed(content=text)
        if self.mode == "named":
            return Parsed(calls=[ToolCall(self.named or "", text)])
        return Parsed(calls=[ToolCall(c["name"], json.dumps(c["parameters"])) for c in value])

    def _parse(self, text: str, final: bool) -> Parsed:
        if self._forced:
            self._forced_text += text
            return self._forced_calls(self._forced_text) if final else Parsed()
        parsed = self._parser.feed(text)
        return parsed.add(self._parser.finish()) if final else parsed

    def _call_dicts(self, calls: list[ToolCall], index: bool) -> list[dict[str, Any]]:
        out = []
        for call in calls:
            entry: dict[str, Any] = {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments},
            }
            if index:
                entry = {"index": len(self.calls), **entry}
            self.calls.append(call)
            out.append(entry)
        return out

    def _named_delta(self, text: str) -> dict[str, Any]:
        """A named function's arguments stream as they come: the call's id and name first."""
        if self.calls:
            return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]} if text else {}
        (entry,) = self._call_dicts([ToolCall(self.named or "", text)], index=True)
        return {"tool_calls": [entry]}

    def delta(self, text: str, final: bool) -> dict[str, Any]:
        """The fields of a stream chunk's delta for `text` (only those with something)."""
        if self.mode == "named":
            return self._named_delta(text)
        parsed = self._parse(text, final)
        out: dict[str, Any] = {}
        if parsed.reasoning:
            out["reasoning_content"] = parsed.reasoning
        if parsed.content:
            out["content"] = parsed.content
        if parsed.calls:
            out["tool_calls"] = self._call_dicts(parsed.calls, index=True)
        return out

    def message(self, text: str) -> dict[str, Any]:
        """The message fields of a whole body."""
        parsed = self._parse(text, final=True)
        out: dict[str, Any] = {"content": parsed.content or (None if parsed.calls else "")}
        if parsed.reasoning or self._parser.reasoning is not None:
            out["reasoning_content"] = parsed.reasoning or None
        if parsed.calls:
            out["tool_calls"] = self._call_dicts(parsed.calls, index=False)
        return out

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's: "tool_calls" when the model chose to call; a forced named call "stop"."""
        if reason == "stop" and self.calls and self.mode != "named":
            return "tool_calls"
        return reason
