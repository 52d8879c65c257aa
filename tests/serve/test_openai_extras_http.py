"""logit_bias, allowed_token_ids and structured outputs over real HTTP with the official openai
client, on the random model (byte tokenizer: token id = byte), and their bad values."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.serve.conftest import ENGINE_ARGS, start_cluster, stop_cluster

MODEL = "ppserve-random"
# Room for prompts that list tools (the byte tokenizer: a token per byte).
ARGS = {**ENGINE_ARGS, "max_model_len": 1536, "num_kv_blocks": 256, "chunk_size": 128}
MESSAGES = [{"role": "user", "content": "Describe a pipeline."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "stage": {"type": "integer", "minimum": 0, "maximum": 7},
        "busy": {"type": "boolean"},
        "kind": {"enum": ["hidden", "output"]},
    },
    "required": ["stage", "busy", "kind"],
    "additionalProperties": False,
}
JSON_SCHEMA_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "stage", "schema": SCHEMA, "strict": True},
}


@pytest.fixture(scope="module")
def client():
    try:
        yield start_cluster({"extras": ("/", ARGS)}).client()
    finally:
        stop_cluster()


def sampled_chat(client, *, seed, **kw):
    """A chat completion of MESSAGES at temperature 1, seeded: the same text every run."""
    return client.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=1.0, seed=seed, **kw
    )


def refused(call, **kw) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as e:
        call(model=MODEL, **kw)
    return e.value


def test_logit_bias_forces_and_bans_tokens(client):
    r = client.completions.create(
        model=MODEL, prompt="x", max_tokens=6, temperature=0, logit_bias={"65": 100}
    )
    assert r.choices[0].text == "AAAAAA"  # token 65 is the byte "A"
    chat = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=4,
        temperature=0.8,
        seed=1,
        logit_bias={str(t): -100 for t in range(97, 123)},
    )
    assert not any("a" <= ch <= "z" for ch in chat.choices[0].message.content)
    only = client.completions.create(
        model=MODEL,
        prompt="x",
        max_tokens=12,
        temperature=1.0,
        extra_body={"allowed_token_ids": [66, 67]},
    )
    assert set(only.choices[0].text) <= {"B", "C"} and len(only.choices[0].text) == 12
    # "A" is forced, but "AA" is a bad word: every other token has to be the other one
    ab = client.completions.create(
        model=MODEL,
        prompt="x",
        max_tokens=6,
        temperature=0,
        logit_bias={"65": 100},
        extra_body={"allowed_token_ids": [65, 66], "bad_words": ["AA"]},
    )
    assert ab.choices[0].text == "ABABAB"


@pytest.mark.parametrize(
    "bias,named",
    [
        ({"x1": 5}, "'x1'"),
        ({"65": 101}, "101"),
        ({"320": 1}, "vocabulary of 320"),
        ({"65": "big"}, "65"),
    ],
)
def test_bad_logit_bias(client, bias, named):
    e = refused(client.completions.create, prompt="x", logit_bias=bias)
    assert e.body["param"].startswith("logit_bias") and named in e.body["message"]


def test_every_bad_logit_bias_entry_named(client):
    bad = {"x1": 5, "65": 101, "66": "big", "y": 1, "67": -2}
    for call, kw in [
        (client.completions.create, {"prompt": "x"}),
        (client.chat.completions.create, {"messages": MESSAGES, "stream": True}),
    ]:
        e = refused(call, logit_bias=bad, **kw)
        message = e.body["message"]
        assert e.body["param"] == "logit_bias"
        assert all(named in message for named in ("'x1'", "'y'", "101", "'66'", "'big'"))
        assert "67" not in message  # a good entry
    # out of the vocabulary (320 ids): known to the pipeline only, every one named there
    e = refused(client.completions.create, prompt="x", logit_bias={"320": 1, "65": 1, "999": -1})
    assert e.body["param"] == "logit_bias"
    assert "token ids 320, 999 are out of range for a vocabulary of 320" in e.body["message"]


def test_json_schema_output_validates(client):
    r = sampled_chat(
        client,
        seed=7,
        max_tokens=100,
        response_format=JSON_SCHEMA_FORMAT,
    )
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    stream = sampled_chat(
        client,
        seed=8,
        max_tokens=100,
        stream=True,
        response_format=JSON_SCHEMA_FORMAT,
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_json_schema_under_n_choices(client):
    # each choice has its own matcher; seeded choices differ, all validate
    r = sampled_chat(
        client,
        seed=11,
        max_tokens=100,
        n=2,
        response_format=JSON_SCHEMA_FORMAT,
    )
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), SCHEMA)
    stream = client.completions.create(
        model=MODEL,
        prompt=["{", "JSON: "],
        max_tokens=100,
        n=2,
        temperature=1.0,
        seed=12,
        stream=True,
        extra_body={"guided_json": SCHEMA},
    )
    texts: dict[int, str] = {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert sorted(texts) == [0, 1, 2, 3]
    for text in texts.values():
        jsonschema.validate(json.loads(text), SCHEMA)


def test_cut_json_is_a_valid_prefix_and_other_constraints(client):
    r = client.completions.create(
        model=MODEL,
        prompt="{",
        max_tokens=4,
        temperature=1.0,
        seed=3,
        extra_body={"guided_json": SCHEMA},
    )
    assert r.choices[0].finish_reason == "length" and '{"stage": '.startswith(r.choices[0].text)
    obj = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=3, response_format={"type": "json_object"}
    )
    assert obj.choices[0].message.content.startswith("{")
    choice = client.completions.create(
        model=MODEL, prompt="Pick: ", max_tokens=20, extra_body={"guided_choice": ["left", "right"]}
    )
    assert choice.choices[0].text in ("left", "right")
    regex = client.completions.create(
        model=MODEL,
        prompt="Id: ",
        max_tokens=20,
        extra_body={"structured_outputs": {"regex": "[A-F]{4}"}},
    )
    assert len(regex.choices[0].text) == 4 and set(regex.choices[0].text) <= set("ABCDEF")


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "s", "schema": {"type": "nope"}},
                }
            },
            "response_format",
        ),
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"structured_outputs": {"grammar": "start: nowhere"}}, "structured_outputs"),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ],
)
def test_bad_constraints_refused(client, extra, param):
    e = refused(client.chat.completions.create, messages=MESSAGES, extra_body=extra)
    assert e.body["param"].startswith(param), e.body


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
NOW = {
    "type": "function",
    "function": {
        "name": "now",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
}
TOOLS = [WEATHER, NOW]


def _check_call(call):
    if call.function.name == "get_weather":
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    else:
        assert call.function.name == "now" and json.loads(call.function.arguments) == {}
    assert call.id.startswith("call_") and call.type == "function"


def test_named_tool_choice_makes_a_valid_call(client):
    r = sampled_chat(
        client,
        seed=2,
        max_tokens=60,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    _check_call(call)
    stream = sampled_chat(
        client,
        seed=2,
        max_tokens=60,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        stream=True,
    )
    calls, reasons = _streamed_calls(stream)
    assert reasons == ["stop"] and calls == [
        {"name": "get_weather", "arguments": call.function.arguments, "id": calls[0]["id"]}
    ]


def _streamed_calls(stream):
    calls: dict[int, dict] = {}
    reasons = []
    for chunk in stream:
        for c in chunk.choices:
            reasons.append(c.finish_reason)
            for d in c.delta.tool_calls or ():
                entry = calls.setdefault(d.index, {"name": "", "arguments": "", "id": d.id})
                entry["name"] += d.function.name or ""
                entry["arguments"] += d.function.arguments or ""
    return list(calls.values()), [r for r in reasons if r]


def test_required_tool_choice_streamed(client):
    stream = sampled_chat(
        client,
        seed=5,
        max_tokens=120,
        tools=TOOLS,
        tool_choice="required",
        stream=True,
    )
    calls, reasons = _streamed_calls(stream)
    assert reasons == ["tool_calls"] and calls
    for c in calls:
        assert c["name"] in ("get_weather", "now") and c["id"].startswith("call_")
        if c["name"] == "get_weather":
            jsonschema.validate(json.loads(c["arguments"]), WEATHER["function"]["parameters"])


def test_auto_parses_the_models_own_hermes_call(client):
    # The random model is made to write a Hermes call (a regex); "auto" finds it in the text.
    written = (
        r'Checking\. <tool_call>\n\{"name": "get_weather", "arguments": '
        r'\{"city": "(Paris|Rome)", "unit": "C"\}\}\n</tool_call>'
    )
    kw = dict(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=150,
        tools=TOOLS,
        extra_body={"guided_regex": written},
    )
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking. "
    _check_call(choice.message.tool_calls[0])
    calls, reasons = _streamed_calls(client.chat.completions.create(**kw, stream=True))
    assert reasons == ["tool_calls"] and [c["name"] for c in calls] == ["get_weather"]
    plain = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=8, tools=TOOLS, tool_choice="none"
    )
    assert plain.choices[0].message.tool_calls is None


@pytest.mark.parametrize(
    "extra,param",
    [
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
        ({"tools": [{"type": "retrieval"}]}, "tools"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
    ],
)
def test_bad_tool_fields_refused(client, extra, param):
    e = refused(client.chat.completions.create, messages=MESSAGES, extra_body=extra)
    assert e.body["param"].startswith(param), e.body


def test_echo_prompt_logprobs_agree_with_sampled_logprobs(client):
    # A prompt of 3 prefill chunks (128 tokens each) whose last token, "A", was sampled after
    # the rest: its prompt logprob is the logprob the first request reports (raw, before the
    # bias that forced it).
    prefix = [256, *"The stages of a pipeline pass hidden states along. ".encode() * 6]
    first = client.completions.create(
        model=MODEL, prompt=prefix, max_tokens=1, temperature=0, logprobs=0, logit_bias={"65": 100}
    )
    flp = first.choices[0].logprobs
    assert flp.tokens == ["A"] and flp.top_logprobs[0] == {"A": flp.token_logprobs[0]}
    prompt = [*prefix, 65]
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=2, temperature=0, echo=True, logprobs=1
    )
    lp, n = r.choices[0].logprobs, len(prompt)
    assert r.usage.prompt_tokens == n > 256 and len(lp.tokens) == n + 2
    echoed = "<bos>" + bytes(prompt[1:]).decode()  # the echo keeps special tokens
    assert r.choices[0].text.startswith(echoed) and "".join(lp.tokens[:n]) == echoed
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    assert lp.tokens[n - 1] == "A"
    assert lp.token_logprobs[n - 1] == pytest.approx(flp.token_logprobs[0], abs=1e-4)
    stream = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=2,
        temperature=0,
        stream=True,
        extra_body={"prompt_logprobs": 0},
    )
    chunks = [c.choices[0].model_extra.get("prompt_logprobs") for c in stream if c.choices]
    scored = next(c for c in chunks if c)
    assert scored[0] is None and len(scored) == n
    assert scored[n - 1]["65"]["logprob"] == pytest.approx(flp.token_logprobs[0], abs=1e-4)


@pytest.mark.parametrize("extra", [{"prompt_logprobs": 21}, {"prompt_logprobs": -1}])
def test_bad_prompt_logprobs(client, extra):
    e = refused(client.completions.create, prompt="x", extra_body=extra)
    assert e.body["param"] == "prompt_logprobs"
