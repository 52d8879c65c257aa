"""logit_bias, allowed_token_ids and structured outputs over real HTTP with the official openai
client, on the random model (byte tokenizer: token id = byte), and their bad values."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.serve.conftest import ENGINE_ARGS, start_cluster, stop_cluster

MODEL = "ppserve-random"
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
        yield start_cluster({"extras": ("/", ENGINE_ARGS)}).client()
    finally:
        stop_cluster()


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


def test_json_schema_output_validates(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=100,
        temperature=1.0,
        seed=7,
        response_format=JSON_SCHEMA_FORMAT,
    )
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=100,
        temperature=1.0,
        seed=8,
        stream=True,
        response_format=JSON_SCHEMA_FORMAT,
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
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
        ({"guided_regex": "(unclosed"}, "response_format"),
        ({"guided_choice": []}, "response_format"),
        ({"guided_json": "{not json"}, "response_format"),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ],
)
def test_bad_constraints_refused(client, extra, param):
    e = refused(client.chat.completions.create, messages=MESSAGES, extra_body=extra)
    assert e.body["param"].startswith(param), e.body
