"""Chat output as the client sees it: reasoning text, content and tool calls, split delta by
delta from the generated text (pure Python).

Tool-call formats, chosen from the chat template (app/server.py):
- ``hermes`` (Hermes, Qwen 2.5 / 3, and the prompt ppserve writes for templates without tool
  support): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``;
- ``deepseek`` (DeepSeek V3 and V3.1 / V3.2): ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
  ```json ARGS```<｜tool▁call▁end｜>`` (V3) or ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS
  <｜tool▁call▁end｜>`` (V3.1), wrapped in ``<｜tool▁calls▁begin｜>...<｜tool▁calls▁end｜>``.

Reasoning (``<think>...</think>``) is split off first, where the template marks it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

TOOL_FORMATS = ("hermes", "deepseek")
THINK_START, THINK_END = "<think>", "</think>"
DS_CALLS_BEGIN, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN, DS_CALL_END, DS_SEP = (
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁sep｜>",
)


Run = tuple[bool, str, bool]  # (inside the tags, text, the run ends at a closing tag)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI's `function.arguments`


@dataclass
class Parsed:
    """What one delta of text adds."""

    content: str = ""
    reasoning: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    def add(self, other: Parsed) -> Parsed:
        return Parsed(
            self.content + other.content, self.reasoning + other.reasoning, self.calls + other.calls
        )


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that begins `tag` (it may be cut mid-tag)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class TagSplitter:
    """Splits text into outside / inside runs of start ... end tags, across deltas."""

    def __init__(self, start: str, end: str, inside: bool = False) -> None:
        self.start, self.end, self.inside = start, end, inside
        self._buf = ""

    def feed(self, text: str) -> list[Run]:
        """(inside, text, closed) runs: `closed` marks the end of an inside run."""
        self._buf += text
        runs: list[Run] = []
        while True:
            tag = self.end if self.inside else self.start
            i = self._buf.find(tag)
            if i < 0:
                break
            runs.append((self.inside, self._buf[:i], self.inside))
            self._buf = self._buf[i + len(tag) :]
            self.inside = not self.inside
        keep = _held_prefix(self._buf, self.end if self.inside else self.start)
        cut = len(self._buf) - keep
        if cut > 0:
            runs.append((self.inside, self._buf[:cut], False))
            self._buf = self._buf[cut:]
        return [r for r in runs if r[1] or r[2]]

    def flush(self) -> list[Run]:
        rest, self._buf = self._buf, ""
        return [(self.inside, rest, False)] if rest else []


class TagDropper:
    """Removes marker tags from streamed text, holding back what may be a cut tag."""

    def __init__(self, tags: tuple[str, ...]) -> None:
        self.tags = tags
        self._buf = ""

    def feed(self, text: str, final: bool = False) -> str:
        self._buf += text
        for tag in self.tags:
            self._buf = self._buf.replace(tag, "")
        keep = 0 if final else max((_held_prefix(self._buf, t) for t in self.tags), default=0)
        out, self._buf = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep :]
        return out


def _hermes_call(body: str) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args))


def _deepseek_call(body: str) -> ToolCall | None:
    head, sep, rest = body.partition(DS_SEP)
    if not sep:
        return None
    if head.strip() == "function":  # V3: NAME\n```json\nARGS\n```
        name, _, args = rest.partition("\n")
        args = args.strip().removeprefix("```json").removesuffix("```").strip()
    else:  # V3.1: NAME<sep>ARGS
        name, args = head, rest
    name, args = name.strip(), args.strip()
    try:
        json.loads(args)
    except ValueError:
        return None
    return ToolCall(name, args) if name else None


_FORMATS: dict[str, tuple[str, str, Callable[[str], ToolCall | None], tuple[str, ...]]] = {
    "hermes": ("<tool_call>", "</tool_call>", _hermes_call, ()),
    "deepseek": (DS_CALL_BEGIN, DS_CALL_END, _deepseek_call, (DS_CALLS_BEGIN, DS_CALLS_END)),
}


class ToolCallParser:
    """Content and tool calls of one choice (tool_choice "auto"): text outside the tags
    streams as content; a call is emitted whole once its closing tag arrives."""

    def __init__(self, fmt: str) -> None:
        if fmt not in _FORMATS:
            raise ValueError(f"unknown tool-call format {fmt!r}; one of {TOOL_FORMATS}")
        start, end, self._parse, self._wrappers = _FORMATS[fmt]
        self._start = start
        self._split = TagSplitter(start, end)
        self._body = ""
        self._drop = TagDropper(self._wrappers)

    def _runs(self, runs: list[Run], final: bool) -> Parsed:
        out = self._calls(runs, final)
        out.content = self._drop.feed(out.content, final)
        return out

    def _calls(self, runs: list[Run], final: bool) -> Parsed:
        out = Parsed()
        for inside, text, closed in runs:
            if not inside:
                out.content += text
                continue
            self._body += text
            if closed or final:
                call = self._parse(self._body)
                if call is None:  # not a call after all: what the model wrote is content
                    out.content += self._start + self._body
                else:
                    out.calls.append(call)
                self._body = ""
        return out

    def feed(self, text: str) -> Parsed:
        return self._runs(self._split.feed(text), final=False)

    def finish(self) -> Parsed:
        out = self._runs(self._split.flush(), final=True)
        if self._body:  # a call cut off (max_tokens): parse what there is
            out = out.add(self._runs([(True, "", True)], final=True))
        return out


class ReasoningParser:
    """Splits `<think>...</think>` off as reasoning; `inside`: the prompt opened it."""

    def __init__(self, inside: bool = False) -> None:
        self._split = TagSplitter(THINK_START, THINK_END, inside)

    @staticmethod
    def _parsed(runs: list[Run]) -> Parsed:
        out = Parsed()
        for inside, text, _closed in runs:
            if inside:
                out.reasoning += text
            else:
                out.content += text
        return out

    def feed(self, text: str) -> Parsed:
        return self._parsed(self._split.feed(text))

    def finish(self) -> Parsed:
        return self._parsed(self._split.flush())


class ChatOutputParser:
    """Reasoning first, then tool calls in what is left (either may be off)."""

    def __init__(self, tool_format: str | None, reasoning: ReasoningParser | None) -> None:
        self.tools = ToolCallParser(tool_format) if tool_format else None
        self.reasoning = reasoning

    def _tools(self, parsed: Parsed, final: bool) -> Parsed:
        if self.tools is None:
            return parsed
        rest = self.tools.feed(parsed.content)
        if final:
            rest = rest.add(self.tools.finish())
        return Parsed(rest.content, parsed.reasoning, rest.calls)

    def feed(self, text: str) -> Parsed:
        parsed = self.reasoning.feed(text) if self.reasoning else Parsed(text)
        return self._tools(parsed, final=False)

    def finish(self) -> Parsed:
        parsed = self.reasoning.finish() if self.reasoning else Parsed()
        return self._tools(parsed, final=True)


def chat_format(tokenizer: Any, prompt_ids: list[int]) -> dict[str, Any]:
    """Accepted's chat fields for a prompt rendered by `tokenizer`'s template: the tool-call
    format the template uses (Hermes where it has none: ppserve's own tool prompt), and
    whether the reply starts inside `<think>` (None: the template marks no reasoning)."""
    template = getattr(tokenizer, "chat_template", "") or ""
    fmt = "deepseek" if DS_CALL_BEGIN in template else "hermes"
    thinking = None
    if THINK_END in template:
        tail = tokenizer.decode(prompt_ids[-8:], skip_special_tokens=False)
        thinking = tail.rstrip().endswith(THINK_START)
    return {"tool_format": fmt, "thinking": thinking}
