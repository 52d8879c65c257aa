"""The OpenAI request models refuse bad input before anything reaches the engine: non-finite
numbers, wrong types, messages without content, text that is not UTF-8, out-of-range values."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from app.openai.protocol import ChatCompletionRequest, CompletionRequest, describe_error
from app.request import InvalidRequest, SamplingParams

MSG = [{"role": "user", "content": "hi"}]


def refused(schema, body: dict) -> str:
    """The field the request is refused on (pydantic's location or InvalidRequest.param)."""
    try:
        req = schema.model_validate(body)
        req.sampling_params()
        req.prompt_fields()
    except ValidationError as e:
        message, param = describe_error(e)
        assert param in message
        return param
    except InvalidRequest as e:
        return e.param or ""
    raise AssertionError(f"accepted: {body}")


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "presence_penalty",
                                   "frequency_penalty", "repetition_penalty"])
@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_non_finite_numbers(field, value):
    # What Python's json module makes of these literals, as the ingress parses bodies with it.
    body = json.loads(f'{{"prompt": "x", "{field}": {value}}}')
    assert refused(CompletionRequest, body).startswith(field)
    assert refused(ChatCompletionRequest, {"messages": MSG, field: body[field]}) == field


def test_non_finite_logit_bias():
    body = json.loads('{"prompt": "x", "logit_bias": {"5": NaN}}')
    assert refused(CompletionRequest, body).startswith("logit_bias")


@pytest.mark.parametrize("body", [
    {"prompt": "x", "max_tokens": "5"}, {"prompt": "x", "max_tokens": 2.5},
    {"prompt": "x", "max_tokens": True}, {"prompt": "x", "stream": 1},
    {"prompt": "x", "stream": "true"}, {"prompt": "x", "temperature": "0.5"},
    {"prompt": "x", "seed": "7"}, {"prompt": "x", "stop": 5}, {"prompt": 12},
    {"prompt": {"text": "x"}}, {"prompt": [1, "a"]}, {"prompt": [True, 2]},
    {"prompt": "x", "stop_token_ids": ["1"]}, {"prompt": "x", "model": 3},
])
def test_wrong_types(body):
    assert refused(CompletionRequest, body) in body


@pytest.mark.parametrize("messages", [
    [{"role": "user"}], [{"role": "user", "content": None}], [{"role": 5, "content": "x"}],
    [{"content": "x"}], ["hello"], [{"role": "user", "content": 5}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
])
def test_bad_messages(messages):
    assert refused(ChatCompletionRequest, {"messages": messages}).startswith("messages")
    assert refused(ChatCompletionRequest, {"messages": []}) == "messages"


@pytest.mark.parametrize("field", ["prompt", "stop", "user", "suffix"])
def test_lone_surrogates_refused(field):
    body = json.loads(f'{{"prompt": "x", "{field}": "a\\ud800b"}}')
    assert refused(CompletionRequest, body) == field
    chat = json.loads('{"messages": [{"role": "user", "content": "\\udfff"}]}')
    assert refused(ChatCompletionRequest, chat) == "messages.content"


@pytest.mark.parametrize("body,param", [
    ({"max_tokens": -1}, "max_tokens"), ({"max_tokens": 0}, "max_tokens"),
    ({"n": 0}, "n"), ({"n": 129}, "n"), ({"seed": 2 ** 63}, "seed"),
    ({"seed": -2 ** 63 - 1}, "seed"), ({"prompt": ["a"] * 65, "n": 2}, "prompt"),
    ({"n": 2, "best_of": 3}, "best_of"), ({"logprobs": 21}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"top_p": 0}, "top_p"), ({"temperature": -0.1}, "temperature"),
    ({"min_tokens": -3}, "min_tokens"), ({"best_of": 3}, "best_of"),
])
def test_out_of_range_values(body, param):
    assert refused(CompletionRequest, {"prompt": "x", **body}) == param


def test_chat_logprob_limits():
    assert refused(ChatCompletionRequest, {"messages": MSG, "logprobs": True,
                                           "top_logprobs": 21}) == "logprobs"
    assert refused(ChatCompletionRequest, {"messages": MSG, "max_completion_tokens": -5}) \
        == "max_tokens"


def test_valid_requests_still_accepted():
    req = CompletionRequest.model_validate({"prompt": [1, 2, 3], "max_tokens": 4,
                                            "temperature": 0, "top_p": 1, "stop": ["x"]})
    assert req.sampling_params().temperature == 0.0 and req.prompts() == [[1, 2, 3]]
    chat = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "system", "content": ""},
                      {"role": "user", "content": [{"type": "text", "text": "a"}]}]})
    assert chat.prompt_fields()["messages"] == [{"role": "system", "content": ""},
                                                {"role": "user", "content": "a"}]
    # any role goes to the chat template, which alone may refuse it (as in vLLM)
    narrated = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "narrator", "content": "x"}]})
    assert narrated.prompt_fields()["messages"] == [{"role": "narrator", "content": "x"}]


def test_stop_token_ids_checked_against_the_vocabulary():
    SamplingParams(stop_token_ids=(0, 255)).check_vocab(256)
    for bad in (256, -1, 10 ** 30):
        with pytest.raises(InvalidRequest, match="out of range") as e:
            SamplingParams(stop_token_ids=(3, bad)).check_vocab(256)
        assert e.value.param == "stop_token_ids"
