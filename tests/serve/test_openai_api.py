"""The real Serve app over real HTTP with the official openai client: greedy text equals the
engine's, streaming framing, /v1/models, /health, and every error case."""

from __future__ import annotations

import json
import uuid

import httpx
import openai
import pytest

from tests.serve.conftest import ENGINE_ARGS, start_cluster, stop_cluster

KEY = "sekret"
ORIGIN = "https://app.example.com"  # the keyed app's one CORS origin
PROMPT = "The quick brown fox jumps over the lazy dog. " * 3
MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Say something about pipelines."}]


@pytest.fixture(scope="module")
def served(fast_metrics):  # bench serve reads the skip counters
    apps = {"ppserve": ("/", ENGINE_ARGS),
            "keyed": ("/keyed", {**ENGINE_ARGS, "pp": 1, "api_key": KEY,
                                 "allowed_origins": [ORIGIN]})}
    try:
        yield start_cluster(apps)
    finally:
        stop_cluster()


@pytest.fixture(scope="module")
def engine(served):
    from app.config import EngineConfig
    from app.engine import Engine

    eng = Engine(EngineConfig.from_dict(ENGINE_ARGS))
    yield eng
    eng.shutdown()


def greedy(engine, prompt, max_tokens=24):
    from app.request import SamplingParams

    return engine.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0))[0]


def test_health_and_models(served):
    assert httpx.get(f"{served.base_url}/health").json() == {"status": "ok"}
    models = served.client().models.list()
    assert [m.id for m in models.data] == ["ppserve-random"]
    assert models.data[0].model_extra["max_model_len"] == 512


def test_completion_matches_engine(served, engine):
    want = greedy(engine, PROMPT)
    c = served.client()
    r = c.completions.create(model="ppserve-random", prompt=PROMPT, max_tokens=24,
                             temperature=0)
    assert r.choices[0].text == want.text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == want.prompt_tokens
    assert r.usage.completion_tokens == 24 and r.usage.total_tokens == want.prompt_tokens + 24
    chunks = list(c.completions.create(model="ppserve-random", prompt=PROMPT, max_tokens=24,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want.text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24


def test_token_id_prompt(served, engine):
    ids = list(range(65, 65 + 40))
    want = greedy(engine, ids, 8)
    r = served.client().completions.create(model="ppserve-random", prompt=ids, max_tokens=8,
                                           temperature=0)
    assert r.choices[0].text == want.text and r.usage.prompt_tokens == 40


def test_chat_matches_engine(served, engine):
    from app.tokenizer import load_tokenizer

    want = greedy(engine, load_tokenizer(None).apply_chat_template(MESSAGES), 20)
    c = served.client()
    r = c.chat.completions.create(model="ppserve-random", messages=MESSAGES, max_tokens=20,
                                  temperature=0)
    assert r.choices[0].message.content == want.text
    assert r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == want.prompt_tokens and r.usage.completion_tokens == 20
    stream = c.chat.completions.create(model="ppserve-random", messages=MESSAGES,
                                       max_tokens=20, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_sse_framing_ends_with_done(served):
    body = {"prompt": "hi", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{served.base_url}/v1/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[0][6:])["object"] == "text_completion"


def test_echo(served):
    r = served.client().completions.create(model="ppserve-random", prompt="abc", max_tokens=3,
                                           temperature=0, echo=True)
    assert r.choices[0].text.startswith("abc")


# -- n, batched prompts, streaming usage ----------------------------------------------------------

def by_index(chunks, chat: bool) -> dict[int, str]:
    """Streamed text per choice index."""
    texts: dict[int, str] = {}
    for ch in chunks:
        for c in ch.choices:
            piece = (c.delta.content or "") if chat else c.text
            texts[c.index] = texts.get(c.index, "") + piece
    return texts


def test_n_choices_seeded_with_logprobs_share_the_prompt(served):
    """n=3 with a seed and logprobs: each choice its own index and logprobs, choice i what a
    lone request with seed + i samples, and choices 1..2 prefill from choice 0's cached
    blocks rather than again."""
    c = served.client()
    prompt = f"{uuid.uuid4().hex} " + PROMPT  # nothing of it is cached yet
    kwargs = {"model": "ppserve-random", "max_tokens": 6, "temperature": 1.0, "seed": 7}
    hits0 = served.stats()["prefix_cache_hits"]
    r = c.completions.create(prompt=prompt, n=3, logprobs=2, **kwargs)
    hits = served.stats()["prefix_cache_hits"] - hits0
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    n_prompt = r.usage.prompt_tokens
    assert n_prompt > 2 * 16  # more than a block: something to share
    assert r.usage.completion_tokens == 18 and r.usage.total_tokens == n_prompt + 18
    assert hits == 2 * ((n_prompt - 1) // 16 * 16)
    for ch in r.choices:
        assert len(ch.logprobs.tokens) == 6
        assert all(len(t) >= 1 for t in ch.logprobs.top_logprobs)
    assert len({ch.text for ch in r.choices}) > 1
    for i in (1, 2):
        alone = c.completions.create(prompt=prompt, **{**kwargs, "seed": 7 + i})
        assert alone.choices[0].text == r.choices[i].text


def test_n_choices_chat_streamed_and_not(served):
    c = served.client()
    kwargs = {"model": "ppserve-random", "messages": MESSAGES, "max_tokens": 5, "n": 2,
              "seed": 11, "temperature": 1.0}
    whole = c.chat.completions.create(**kwargs)
    assert [ch.index for ch in whole.choices] == [0, 1]
    assert all(ch.message.role == "assistant" for ch in whole.choices)
    assert whole.usage.completion_tokens == 10
    chunks = list(c.chat.completions.create(**kwargs, stream=True,
                                            stream_options={"include_usage": True}))
    firsts = {}
    for ch in chunks:
        for choice in ch.choices:
            firsts.setdefault(choice.index, choice.delta)
    assert {i: d.role for i, d in firsts.items()} == {0: "assistant", 1: "assistant"}
    assert by_index(chunks, chat=True) == {i: ch.message.content
                                           for i, ch in enumerate(whole.choices)}
    finishes = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert sorted(f.index for f in finishes) == [0, 1]
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_batched_prompts(served, engine):
    """A list of strings and a list of token-id lists: one choice per prompt x n, in order,
    usage summed; streamed, chunks tagged by choice index."""
    c = served.client()
    prompts = ["The quick brown fox", "Pipelines of stages"]
    want = [greedy(engine, p, 5) for p in prompts]
    r = c.completions.create(model="ppserve-random", prompt=prompts, n=2, max_tokens=5,
                             temperature=0)
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
    assert [ch.text for ch in r.choices] == [want[0].text] * 2 + [want[1].text] * 2
    assert r.usage.prompt_tokens == sum(w.prompt_tokens for w in want)
    assert r.usage.completion_tokens == 20
    ids = [list(range(70, 90)), list(range(100, 130))]
    r = c.completions.create(model="ppserve-random", prompt=ids, max_tokens=4, temperature=0)
    assert [ch.text for ch in r.choices] == [greedy(engine, p, 4).text for p in ids]
    assert r.usage.prompt_tokens == 50 and r.usage.completion_tokens == 8
    chunks = list(c.completions.create(model="ppserve-random", prompt=prompts, max_tokens=5,
                                       temperature=0, stream=True, echo=True,
                                       stream_options={"include_usage": True}))
    assert by_index(chunks, chat=False) == {i: p + w.text
                                            for i, (p, w) in enumerate(zip(prompts, want))}
    assert chunks[-1].usage.prompt_tokens == sum(w.prompt_tokens for w in want)
    assert chunks[-1].usage.completion_tokens == 10


def test_stream_usage_exact(served):
    """include_usage: one usage chunk at the end; continuous_usage_stats: every chunk's
    usage is that choice's so far; the totals equal the tokens streamed (one logprob
    entry each)."""
    c = served.client()
    kwargs = {"model": "ppserve-random", "messages": MESSAGES, "max_tokens": 7,
              "temperature": 0, "stream": True, "logprobs": True}
    chunks = list(c.chat.completions.create(**kwargs, stream_options={
        "include_usage": True, "continuous_usage_stats": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = [lp for ch in chunks for choice in ch.choices
                for lp in (choice.logprobs.content if choice.logprobs else [])]
    body, last = chunks[:-1], chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == len(streamed) == 7
    assert all(ch.usage is not None for ch in body)
    assert body[0].usage.completion_tokens == 0
    counts = [ch.usage.completion_tokens for ch in body]
    assert counts == sorted(counts) and counts[-1] == 7
    assert all(ch.usage.total_tokens == ch.usage.prompt_tokens + ch.usage.completion_tokens
               and ch.usage.prompt_tokens == last.usage.prompt_tokens for ch in body)
    plain = list(c.chat.completions.create(**kwargs, stream_options={"include_usage": True}))
    assert all(ch.usage is None for ch in plain[:-1]) and plain[-1].usage == last.usage
    none = list(c.chat.completions.create(**kwargs))
    assert all(ch.usage is None for ch in none)


def test_bad_values_of_new_fields(served):
    for body, param in [({"n": 0}, "n"), ({"n": 129}, "n"), ({"n": 2, "best_of": 3}, "best_of"),
                        ({"seed": 2 ** 63}, "seed"), ({"seed": -2 ** 63 - 1}, "seed"),
                        ({"prompt": ["a"] * 65, "n": 2}, "prompt"),
                        ({"prompt": [[1, 2], []]}, "prompt")]:
        err = assert_error(post(served, "/v1/completions", {"prompt": "x", **body}), 400)
        assert err["param"] == param, err
    assert_error(post(served, "/v1/chat/completions", {"messages": MESSAGES, "n": -1}), 400,
                 "n must be")
    ok = post(served, "/v1/completions", {"prompt": "x", "max_tokens": 1, "seed": 2 ** 63 - 1})
    assert ok.status_code == 200, ok.text
    with pytest.raises(openai.BadRequestError, match="seed"):
        served.client().completions.create(model="ppserve-random", prompt="x", seed=2 ** 64)
    # A JSON body declared as something else is refused; JSON types with parameters are not.
    raw = json.dumps({"prompt": "x", "max_tokens": 1}).encode()
    err = assert_error(post(served, "/v1/completions", raw, raw=True,
                            headers={"Content-Type": "text/plain"}), 415, "JSON")
    assert err["type"] == "invalid_request_error"
    assert post(served, "/v1/completions", raw, raw=True, headers={
        "Content-Type": "application/json; charset=utf-8"}).status_code == 200


# -- errors over real HTTP ------------------------------------------------------------------------

def post(served, path, body, raw=False, headers=None):
    kwargs = {"content": body} if raw else {"json": body}
    return httpx.post(f"{served.base_url}{path}", headers=headers or {}, timeout=60, **kwargs)


def assert_error(r, status, *words):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    for w in words:
        assert w in err["message"], err["message"]
    return err


def test_invalid_json(served):
    assert_error(post(served, "/v1/completions", b"{not json", raw=True), 400, "JSON")
    assert_error(post(served, "/v1/chat/completions", b"[1, 2]", raw=True), 400, "object")


def test_wrong_types_and_missing_fields(served):
    err = assert_error(post(served, "/v1/completions", {"prompt": "x", "temperature": "hot"}),
                       400, "temperature")
    assert err["param"] == "temperature"
    assert_error(post(served, "/v1/completions", {"prompt": 12}), 400, "prompt")
    assert_error(post(served, "/v1/completions", {"max_tokens": 3}), 400, "prompt")
    assert_error(post(served, "/v1/chat/completions", {"model": "ppserve-random"}), 400,
                 "messages")
    assert_error(post(served, "/v1/chat/completions",
                      {"messages": [{"role": ["user"], "content": "x"}]}), 400, "role")
    # any role is the chat template's to judge (the built-in one takes every role)
    assert post(served, "/v1/chat/completions", {"max_tokens": 2, "messages": [
        {"role": "wizard", "content": "x"}]}).status_code == 200


def test_bad_values(served):
    assert_error(post(served, "/v1/completions", {"prompt": "x", "max_tokens": 0}), 400,
                 "max_tokens")
    assert_error(post(served, "/v1/completions", {"prompt": "x", "n": 0}), 400, "n must be")
    assert_error(post(served, "/v1/completions", {"prompt": "x", "top_p": 0}), 400, "top_p")
    assert_error(post(served, "/v1/completions", {"prompt": [5, 10 ** 6]}), 400,
                 "out of range")
    assert_error(post(served, "/v1/completions", {"prompt": []}), 400, "empty")
    with pytest.raises(openai.BadRequestError) as e:
        served.client().chat.completions.create(model="ppserve-random", messages=MESSAGES,
                                                max_tokens=0)
    assert "max_tokens" in str(e.value)


def test_prompt_too_long(served):
    err = assert_error(post(served, "/v1/completions", {"prompt": "x" * 600}), 400,
                       "maximum context length is 512 tokens")
    assert err["param"] == "prompt"
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        served.client().completions.create(model="ppserve-random", prompt="y" * 600,
                                           max_tokens=4, stream=True)
    # The rejected requests left nothing behind.
    assert served.stats()["num_waiting"] == 0


def test_unknown_model_404(served):
    assert_error(post(served, "/v1/completions", {"model": "gpt-9", "prompt": "x"}), 404,
                 "gpt-9")
    with pytest.raises(openai.NotFoundError):
        served.client().chat.completions.create(model="gpt-9", messages=MESSAGES)


def test_api_key_401(served):
    body = {"prompt": "x", "max_tokens": 2}
    assert_error(post(served, "/keyed/v1/completions", body), 401)
    assert_error(post(served, "/keyed/v1/completions", body,
                      headers={"Authorization": "Bearer wrong"}), 401)
    with pytest.raises(openai.AuthenticationError):
        served.client("wrong", prefix="/keyed").models.list()
    ok = served.client(KEY, prefix="/keyed").completions.create(
        model="ppserve-random", prompt="x", max_tokens=2)
    assert ok.usage.completion_tokens == 2
    assert httpx.get(f"{served.base_url}/keyed/health").status_code == 200  # no key needed
    # The open app stays open.
    assert post(served, "/v1/completions", body).status_code == 200


def test_tokenize_adds_the_special_tokens_a_completion_adds(served):
    """The byte tokenizer puts <bos> (256) before a prompt's UTF-8 bytes, as the engine
    tokenizes a completion's prompt; add_special_tokens=false leaves it out. The keyed app
    asks for its key here too."""
    text = "héllo"
    raw = list(text.encode())
    r = post(served, "/tokenize", {"prompt": text, "return_token_strs": True})
    assert r.status_code == 200, r.text
    assert r.json() == {"count": len(raw) + 1, "max_model_len": 512, "tokens": [256, *raw],
                        "token_strs": ["<bos>", "h", "bytes:\\xc3", "bytes:\\xa9", "l", "l", "o"]}
    usage = served.client().completions.create(model="ppserve-random", prompt=text, max_tokens=1)
    assert usage.usage.prompt_tokens == len(raw) + 1
    r = post(served, "/tokenize", {"prompt": text, "add_special_tokens": False})
    assert r.json()["tokens"] == raw
    r = post(served, "/detokenize", {"tokens": [256, *raw, 257]})
    assert r.json() == {"prompt": f"<bos>{text}<eos>"}
    assert_error(post(served, "/keyed/tokenize", {"prompt": text}), 401)
    keyed = post(served, "/keyed/tokenize", {"prompt": text},
                 headers={"Authorization": f"Bearer {KEY}"})
    assert keyed.json()["tokens"] == [256, *raw]


def _preflight(served, path: str, origin: str) -> httpx.Response:
    return httpx.options(f"{served.base_url}{path}", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})


def test_no_cors_without_allowed_origins(served):
    r = _preflight(served, "/v1/completions", ORIGIN)
    assert r.status_code == 405 and "access-control-allow-origin" not in r.headers
    r = httpx.get(f"{served.base_url}/v1/models", headers={"Origin": ORIGIN})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_cors_for_allowed_origins_only(served):
    r = _preflight(served, "/keyed/v1/completions", ORIGIN)  # no key needed for a preflight
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    other = _preflight(served, "/keyed/v1/completions", "https://evil.example.com")
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    r = httpx.post(f"{served.base_url}/keyed/v1/completions", json={"prompt": "x",
                   "max_tokens": 2}, headers={"Origin": ORIGIN, "Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    r = httpx.post(f"{served.base_url}/keyed/v1/completions", json={"prompt": "x"},
                   headers={"Origin": ORIGIN})
    assert r.status_code == 401  # CORS does not stand in for the key


def test_bench_serve_runs(served, tmp_path):
    from app.bench.serve import main

    out = tmp_path / "bench.json"
    rc = main(["--base-url", served.base_url, "--request-rates", "4", "inf", "--num-prompts", "3",
               "--input-lens", "64", "200", "--output-lens", "4", "--out", str(out),
               "--metrics-url", served.metrics_url, "--metrics-wait", "3"])
    assert rc == 0
    rows = json.loads(out.read_text())["results"]
    assert [r["completed"] for r in rows] == [3, 3]
    assert all(r["total_output_tokens"] == 12 and r["ttft_ms_p50"] > 0 for r in rows)
    for r in rows:  # each rate's own share of the server's skip counters (auto: nothing missed)
        comm = r["pp_output_comm"]
        assert comm["sent"] >= 3 and comm["missed"] == 0 and comm["orphaned"] == 0
