"""The real Serve app over real HTTP with the official openai client: greedy text equals the
engine's, streaming framing, /v1/models, /health, and every error case; each sampling parameter's
observable effect; bad input (malformed requests get OpenAI's error JSON with the right 4xx, and
the next request is served exactly as before).

One cluster for all of them (each Serve cluster costs ~30 s to start and stop on 2 cores): the
sampling and bad-input tests were test_sampling_http.py and test_bad_input_http.py, whose apps
were this module's main app (the bad-input one with --max-request-bytes, which no other request
here comes near)."""

from __future__ import annotations

import asyncio
import json
import math
import uuid

import httpx
import openai
import pytest

from tests.serve.conftest import ENGINE_ARGS, start_cluster, stop_cluster

KEY = "sekret"
LIMIT = 16 << 10  # --max-request-bytes of the main app (the bad-input tests' 413s)
ORIGIN = "https://app.example.com"  # the keyed app's one CORS origin
PROMPT = "The quick brown fox jumps over the lazy dog. " * 3
MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Say something about pipelines."}]


@pytest.fixture(scope="module")
def served(fast_metrics):  # bench serve reads the skip counters
    apps = {"ppserve": ("/", {**ENGINE_ARGS, "max_request_bytes": LIMIT}),
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


# -- sampling: each parameter has an observable effect (was test_sampling_http.py) ---------------

RANDOM = "ppserve-random"
STORY = "Once upon a time, in a pipeline far away, "


@pytest.fixture(scope="module")
def client(served):
    return served.client()


def sample(client, **kw):
    kw.setdefault("max_tokens", 16)
    r = client.completions.create(model=RANDOM, prompt=kw.pop("prompt", STORY), **kw)
    return r.choices[0], r.usage


@pytest.fixture(scope="module")
def greedy_choice(client):
    """The greedy continuation: text and the token ids (from logprobs' byte pieces)."""
    choice, _ = sample(client, temperature=0, logprobs=0, max_tokens=16)
    return choice


def piece_id(piece: str) -> int:
    """The byte tokenizer's id of a logprobs token string."""
    if piece.startswith("bytes:"):
        return int(piece[len("bytes:\\x"):], 16)
    if piece.startswith("<unused"):
        return int(piece[len("<unused"):-1])
    return {"<bos>": 256, "<eos>": 257}.get(piece) or ord(piece)


def test_greedy_equivalents(client, greedy_choice):
    for kw in ({"temperature": 1.0, "extra_body": {"top_k": 1}, "seed": 1},
               {"temperature": 1.0, "top_p": 1e-6, "seed": 2},
               {"temperature": 1.0, "extra_body": {"min_p": 0.999}, "seed": 3}):
        assert sample(client, **kw)[0].text == greedy_choice.text, kw


def test_seed_reproducible(client):
    a = sample(client, temperature=1.0, seed=1234)[0].text
    b = sample(client, temperature=1.0, seed=1234)[0].text
    c = sample(client, temperature=1.0, seed=4321)[0].text
    assert a == b and a != c


def test_seed_reproducible_when_batched(served):
    async def run():
        async with served.async_client() as ac:
            reqs = [ac.completions.create(model=RANDOM, prompt=STORY, max_tokens=12,
                                          temperature=1.0, seed=7 if i % 2 else 8)
                    for i in range(6)]
            return [r.choices[0].text for r in await asyncio.gather(*reqs)]

    texts = asyncio.run(run())
    assert len(set(texts[0::2])) == 1 and len(set(texts[1::2])) == 1


def test_max_tokens_length(client):
    choice, usage = sample(client, temperature=0, max_tokens=5)
    assert choice.finish_reason == "length" and usage.completion_tokens == 5


def test_stop_string_truncates(client):
    # This prompt's greedy text has varied characters (the random model often repeats one).
    text = sample(client, prompt="The", temperature=0)[0].text
    # A stop string from the middle of the greedy text, and one spanning two tokens.
    i = next(i for i in range(1, len(text)) if text[i] != "\ufffd" and text[i] not in text[:i])
    for stop in (text[i], text[i:i + 2]):
        choice, _ = sample(client, prompt="The", temperature=0, stop=["never", stop])
        assert choice.text == text[:i] and choice.finish_reason == "stop"
        choice, _ = sample(client, prompt="The", temperature=0, stop=[stop],
                           extra_body={"include_stop_str_in_output": True})
        assert choice.text == text[:i] + stop


def test_stop_token_ids_and_min_tokens(client, greedy_choice):
    first = piece_id(greedy_choice.logprobs.tokens[0])
    choice, usage = sample(client, temperature=0, extra_body={"stop_token_ids": [first]})
    assert choice.finish_reason == "stop" and usage.completion_tokens == 1
    choice, usage = sample(client, temperature=0, logprobs=0,
                           extra_body={"stop_token_ids": [first], "min_tokens": 4})
    assert usage.completion_tokens >= 4
    assert all(piece_id(p) != first for p in choice.logprobs.tokens[:4])


def test_ignore_eos(served):
    """Find a seeded sample that hits <eos>, then the same request with ignore_eos runs on."""
    async def eos_samples(seeds, ignore_eos):
        async with served.async_client() as ac:
            reqs = [ac.completions.create(model=RANDOM, prompt="x", max_tokens=300,
                                          temperature=50.0, seed=s,
                                          extra_body={"ignore_eos": ignore_eos})
                    for s in seeds]
            return await asyncio.gather(*reqs)

    seeds = list(range(8))
    outs = asyncio.run(eos_samples(seeds, False))
    stopped = [s for s, r in zip(seeds, outs) if r.choices[0].finish_reason == "stop"]
    assert stopped, "no seed sampled <eos> in 300 tokens (chance ~0.05%)"
    seed = stopped[0]
    before = next(r for s, r in zip(seeds, outs) if s == seed)
    assert before.usage.completion_tokens < 300
    after = asyncio.run(eos_samples([seed], True))[0]
    assert after.choices[0].finish_reason == "length" and after.usage.completion_tokens == 300
    assert after.choices[0].text.startswith(before.choices[0].text)


def test_logprobs_completions(client, greedy_choice):
    choice, usage = sample(client, temperature=0, logprobs=3, max_tokens=8)
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and 1 <= len(top) <= 4
        assert math.isclose(value, max(top.values()), abs_tol=1e-5)  # greedy = the best
        assert token in top
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert choice.text == greedy_choice.text[:len(choice.text)]


def test_logprobs_chat_stream(client):
    stream = client.chat.completions.create(
        model=RANDOM, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
        temperature=0, logprobs=True, top_logprobs=2, stream=True)
    entries = [e for ch in stream if ch.choices and ch.choices[0].logprobs
               for e in ch.choices[0].logprobs.content]
    assert len(entries) == 6
    for e in entries:
        assert e.logprob <= 0 and len(e.top_logprobs) == 2 and e.bytes
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob


def test_penalties_change_output(client):
    base = sample(client, temperature=0, max_tokens=24)[0].text
    for kw in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0},
               {"extra_body": {"repetition_penalty": 2.0}}):
        assert sample(client, temperature=0, max_tokens=24, **kw)[0].text != base, kw


def test_temperature_changes_output(client, greedy_choice):
    texts = {sample(client, temperature=2.0, seed=s)[0].text for s in range(3)}
    assert texts != {greedy_choice.text} and len(texts) > 1


# -- bad input: refused with OpenAI's error JSON, then the next request served (was
# test_bad_input_http.py) --------------------------------------------------------------------------

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
def baseline(served):
    r = send(served, C, OK)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def send(served, path, body, **kwargs):
    kw = {"content": body} if isinstance(body, (bytes, type(x for x in ()))) else {"json": body}
    return httpx.post(f"{served.base_url}{path}", timeout=60, **kw, **kwargs)


def assert_still_serving(served, baseline):
    r = send(served, C, OK)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == baseline


@pytest.mark.parametrize("path,body,status,param", CASES,
                         ids=[f"{i}-{c[0].rsplit('/', 1)[1]}" for i, c in enumerate(CASES)])
def test_refused_then_next_request_served(served, baseline, path, body, status, param):
    r = send(served, path, body)
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

    r = send(served, C, chunks())
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
        r = send(served, C, {**OK, "seed": seed, "temperature": 0.7})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6
    r = send(served, C, {**OK, "seed": 2 ** 80})
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed"
    r = send(served, CHAT, {"messages": [{"role": "system", "content": ""}, *MSG],
                            "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert served.stats()["num_waiting"] == 0
