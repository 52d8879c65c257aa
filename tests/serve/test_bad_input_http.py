"""Bad input over real HTTP: every malformed request gets OpenAI's error JSON with the right 4xx
(non-finite numbers, wrong types, messages without content, out-of-range values, token ids
outside the vocabulary, invalid UTF-8, bodies past --max-request-bytes, prompts past
max_model_len), and the next request is served exactly as before."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.serve.conftest import ENGINE_ARGS, start_cluster, stop_cluster

LIMIT = 16 << 10  # --max-request-bytes of this app
OK = {"prompt": "Pipelines keep every stage busy.", "max_tokens": 6, "temperature": 0}
MSG = [{"role": "user", "content": "hi"}]
C, CHAT = "/v1/completions", "/v1/chat/completions"

# (path, body: dict or raw bytes, status, param or None)
CASES = [
    # non-finite numbers, as Python's json module (and many clients) spell them
    (C, b'{"prompt": "x", "temperature": NaN}', 400, "temperature"),
    (C, b'{"prompt": "x", "top_p": Infinity}', 400, "top_p"),
    (C, b'{"prompt": "x", "presence_penalty": -Infinity}', 400, "presence_penalty"),
    (C, b'{"prompt": "x", "frequency_penalty": 1e999}', 400, "frequency_penalty"),
    (C, b'{"prompt": "x", "repetition_penalty": NaN, "stream": true}', 400,
     "repetition_penalty"),
    (C, b'{"prompt": "x", "min_p": NaN}', 400, "min_p"),
    (C, b'{"prompt": "x", "logit_bias": {"5": NaN}}', 400, "logit_bias"),
    (CHAT, b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', 400,
     "temperature"),
    # chat messages
    (CHAT, {"messages": [{"role": "user"}]}, 400, "messages.content"),
    (CHAT, {"messages": [{"role": "user", "content": None}]}, 400, "messages.content"),
    (CHAT, {"messages": [{"role": 5, "content": "x"}]}, 400, "messages.role"),
    (CHAT, {"messages": [{"content": "x"}]}, 400, "messages.role"),
    (CHAT, {"messages": "hello"}, 400, "messages"),
    (CHAT, {"messages": []}, 400, "messages"),
    # wrong types
    (C, {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    (C, {"prompt": "x", "stream": "yes"}, 400, "stream"),
    (C, {"prompt": {"text": "x"}}, 400, "prompt"),
    (C, {"prompt": "x", "stop": 5}, 400, "stop"),
    (CHAT, {"messages": MSG, "max_completion_tokens": 2.5}, 400, "max_completion_tokens"),
    # values out of range
    (C, {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    (C, {"prompt": "x", "max_tokens": 10 ** 12}, 400, "max_tokens"),
    (C, {"prompt": "x", "max_tokens": 2 ** 70, "stream": True}, 400, "max_tokens"),
    (CHAT, {"messages": MSG, "max_tokens": 0}, 400, "max_tokens"),
    (C, {"prompt": "x", "n": 0}, 400, "n"),
    (CHAT, {"messages": MSG, "n": 129}, 400, "n"),
    (C, {"prompt": "x", "seed": 2 ** 64}, 400, "seed"),
    (C, {"prompt": ["x", [1, 2]]}, 400, "prompt"),
    (C, {"prompt": [[1, 2], [5, 320]]}, 400, "prompt"),
    (C, {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    (CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 50}, 400, "logprobs"),
    # token ids outside the vocabulary (320 for the built-in model)
    (C, {"prompt": [5, 320]}, 400, "prompt"),
    (C, {"prompt": [[-1, 4]]}, 400, "prompt"),
    (C, {"prompt": "x", "stop_token_ids": [5, 10 ** 9], "min_tokens": 2}, 400,
     "stop_token_ids"),
    (CHAT, {"messages": MSG, "stop_token_ids": [-3]}, 400, "stop_token_ids"),
    # text that is not UTF-8
    (C, b'{"prompt": "\xff\xfe abc"}', 400, None),
    (C, b'{"prompt": "a\\ud800b"}', 400, "prompt"),
    (CHAT, b'{"messages": [{"role": "user", "content": "\\udfff"}]}', 400,
     "messages.content"),
    # not JSON objects
    (C, b"[" * 10_000, 400, None),
    (C, b"", 400, None),
    # too long
    (C, {"prompt": "x" * 600}, 400, "prompt"),
    (C, {"prompt": "x" * 500, "max_tokens": 100}, 400, "max_tokens"),
    (C, {"prompt": "x" * (LIMIT + 1)}, 413, None),
]


@pytest.fixture(scope="module")
def served():
    try:
        yield start_cluster({"ppserve": ("/", {**ENGINE_ARGS, "max_request_bytes": LIMIT})})
    finally:
        stop_cluster()


@pytest.fixture(scope="module")
def baseline(served):
    r = post(served, C, OK)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def post(served, path, body, **kwargs):
    kw = {"content": body} if isinstance(body, (bytes, type(x for x in ()))) else {"json": body}
    return httpx.post(f"{served.base_url}{path}", timeout=60, **kw, **kwargs)


def assert_still_serving(served, baseline):
    r = post(served, C, OK)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == baseline


@pytest.mark.parametrize("path,body,status,param", CASES,
                         ids=[f"{i}-{c[0].rsplit('/', 1)[1]}" for i, c in enumerate(CASES)])
def test_refused_then_next_request_served(served, baseline, path, body, status, param):
    r = post(served, path, body)
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param, err
    assert_still_serving(served, baseline)


def test_chunked_body_past_the_limit(served, baseline):
    """No Content-Length (chunked transfer): the ingress still stops reading at the limit."""
    def chunks():
        yield b'{"prompt": "'
        for _ in range(LIMIT // 1024 + 2):
            yield b"y" * 1024
        yield b'"}'

    r = post(served, C, chunks())
    assert r.status_code == 413, r.text
    assert str(LIMIT) in r.json()["error"]["message"]
    assert_still_serving(served, baseline)


def test_official_client_sees_the_errors(served, baseline):
    client = served.client()
    with pytest.raises(openai.BadRequestError, match="messages.content"):
        client.chat.completions.create(model="ppserve-random",
                                       messages=[{"role": "user", "content": None}])
    with pytest.raises(openai.BadRequestError, match="n must be"):
        client.completions.create(model="ppserve-random", prompt="x", n=200)
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model="ppserve-random", prompt="z" * (LIMIT + 10))
    assert e.value.status_code == 413
    assert_still_serving(served, baseline)


def test_large_seed_and_empty_content_are_served(served):
    """Valid edge values are not refused: the signed 64-bit range's ends as seeds (past them
    is a 400), an empty system message."""
    for seed in (2 ** 63 - 1, -2 ** 63):
        r = post(served, C, {**OK, "seed": seed, "temperature": 0.7})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6
    r = post(served, C, {**OK, "seed": 2 ** 80})
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed"
    r = post(served, CHAT, {"messages": [{"role": "system", "content": ""}, *MSG],
                            "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert served.stats()["num_waiting"] == 0
