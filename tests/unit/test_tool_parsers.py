"""The chat output parsers: Hermes and DeepSeek tool calls, <think> reasoning, split the same
whatever the deltas' boundaries."""

from __future__ import annotations

import json

import pytest

from app.tool_parsers import ChatOutputParser, Parsed, ReasoningParser, ToolCall

HERMES = (
    'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
    '\n</tool_call><tool_call>{"name": "now", "arguments": {}}</tool_call> Done.'
)
DEEPSEEK_V3 = (
    "Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
    '```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
)
DEEPSEEK_V31 = (
    '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}'
    "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
)
WEATHER = ToolCall("get_weather", '{"city": "Paris"}')


def parse(parser: ChatOutputParser, text: str, step: int) -> Parsed:
    out = Parsed()
    for i in range(0, len(text), step):
        out = out.add(parser.feed(text[i : i + step]))
    return out.add(parser.finish())


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_hermes_calls_split_from_content(step):
    out = parse(ChatOutputParser("hermes", None), HERMES, step)
    assert out.content == "Let me check.  Done."
    assert out.calls == [WEATHER, ToolCall("now", "{}")]
    assert json.loads(out.calls[0].arguments) == {"city": "Paris"}


@pytest.mark.parametrize("text", [DEEPSEEK_V3, DEEPSEEK_V31])
@pytest.mark.parametrize("step", [1, 5, 1000])
def test_deepseek_calls(text, step):
    out = parse(ChatOutputParser("deepseek", None), text, step)
    assert out.calls == [WEATHER]
    assert out.content == ("Sure." if text is DEEPSEEK_V3 else "")


def test_content_streams_before_the_tag_and_waits_only_on_a_possible_tag():
    p = ChatOutputParser("hermes", None)
    assert p.feed("Hello <tool").content == "Hello "  # "<tool" may open a call: held
    assert p.feed("box> more").content == "<toolbox> more"  # it did not


def test_not_a_call_is_content_and_a_cut_call_is_still_parsed():
    bad = parse(ChatOutputParser("hermes", None), "<tool_call>not json</tool_call>", 4)
    assert bad.calls == [] and bad.content == "<tool_call>not json"
    cut = parse(ChatOutputParser("hermes", None), '<tool_call>{"name": "f", "arguments": {}}', 2)
    assert cut.calls == [ToolCall("f", "{}")]


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_reasoning_then_a_call(step):
    text = "<think>The user wants weather.</think>" + HERMES
    out = parse(ChatOutputParser("hermes", ReasoningParser()), text, step)
    assert out.reasoning == "The user wants weather."
    assert out.content == "Let me check.  Done." and len(out.calls) == 2


def test_reasoning_opened_by_the_prompt():
    out = parse(ChatOutputParser(None, ReasoningParser(inside=True)), "hmm, 2+2</think>4", 3)
    assert (out.reasoning, out.content) == ("hmm, 2+2", "4")
