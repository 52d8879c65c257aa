"""Each sampling parameter has an observable effect over HTTP (built-in random model)."""

from __future__ import annotations

import asyncio
import math

import pytest

from tests.serve.conftest import ENGINE_ARGS, start_cluster, stop_cluster

MODEL = "ppserve-random"
PROMPT = "Once upon a time, in a pipeline far away, "


@pytest.fixture(scope="module")
def served():
    try:
        yield start_cluster({"ppserve": ("/", ENGINE_ARGS)})
    finally:
        stop_cluster()


@pytest.fixture(scope="module")
def client(served):
    return served.client()


def complete(client, **kw):
    kw.setdefault("max_tokens", 16)
    r = client.completions.create(model=MODEL, prompt=kw.pop("prompt", PROMPT), **kw)
    return r.choices[0], r.usage


@pytest.fixture(scope="module")
def greedy(client):
    """The greedy continuation: text and the token ids (from logprobs' byte pieces)."""
    choice, _ = complete(client, temperature=0, logprobs=0, max_tokens=16)
    return choice


def piece_id(piece: str) -> int:
    """The byte tokenizer's id of a logprobs token string."""
    if piece.startswith("bytes:"):
        return int(piece[len("bytes:\\x"):], 16)
    if piece.startswith("<unused"):
        return int(piece[len("<unused"):-1])
    return {"<bos>": 256, "<eos>": 257}.get(piece) or ord(piece)


def test_greedy_equivalents(client, greedy):
    for kw in ({"temperature": 1.0, "extra_body": {"top_k": 1}, "seed": 1},
               {"temperature": 1.0, "top_p": 1e-6, "seed": 2},
               {"temperature": 1.0, "extra_body": {"min_p": 0.999}, "seed": 3}):
        assert complete(client, **kw)[0].text == greedy.text, kw


def test_seed_reproducible(client):
    a = complete(client, temperature=1.0, seed=1234)[0].text
    b = complete(client, temperature=1.0, seed=1234)[0].text
    c = complete(client, temperature=1.0, seed=4321)[0].text
    assert a == b and a != c


def test_seed_reproducible_when_batched(served):
    async def run():
        async with served.async_client() as ac:
            reqs = [ac.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12,
                                          temperature=1.0, seed=7 if i % 2 else 8)
                    for i in range(6)]
            return [r.choices[0].text for r in await asyncio.gather(*reqs)]

    texts = asyncio.run(run())
    assert len(set(texts[0::2])) == 1 and len(set(texts[1::2])) == 1


def test_max_tokens_length(client):
    choice, usage = complete(client, temperature=0, max_tokens=5)
    assert choice.finish_reason == "length" and usage.completion_tokens == 5


def test_stop_string_truncates(client):
    # This prompt's greedy text has varied characters (the random model often repeats one).
    text = complete(client, prompt="The", temperature=0)[0].text
    # A stop string from the middle of the greedy text, and one spanning two tokens.
    i = next(i for i in range(1, len(text)) if text[i] != "\ufffd" and text[i] not in text[:i])
    for stop in (text[i], text[i:i + 2]):
        choice, _ = complete(client, prompt="The", temperature=0, stop=["never", stop])
        assert choice.text == text[:i] and choice.finish_reason == "stop"
        choice, _ = complete(client, prompt="The", temperature=0, stop=[stop],
                             extra_body={"include_stop_str_in_output": True})
        assert choice.text == text[:i] + stop


def test_stop_token_ids_and_min_tokens(client, greedy):
    first = piece_id(greedy.logprobs.tokens[0])
    choice, usage = complete(client, temperature=0, extra_body={"stop_token_ids": [first]})
    assert choice.finish_reason == "stop" and usage.completion_tokens == 1
    choice, usage = complete(client, temperature=0, logprobs=0,
                             extra_body={"stop_token_ids": [first], "min_tokens": 4})
    assert usage.completion_tokens >= 4
    assert all(piece_id(p) != first for p in choice.logprobs.tokens[:4])


def test_ignore_eos(served):
    """Find a seeded sample that hits <eos>, then the same request with ignore_eos runs on."""
    async def sample(seeds, ignore_eos):
        async with served.async_client() as ac:
            reqs = [ac.completions.create(model=MODEL, prompt="x", max_tokens=300,
                                          temperature=50.0, seed=s,
                                          extra_body={"ignore_eos": ignore_eos})
                    for s in seeds]
            return await asyncio.gather(*reqs)

    seeds = list(range(8))
    outs = asyncio.run(sample(seeds, False))
    stopped = [s for s, r in zip(seeds, outs) if r.choices[0].finish_reason == "stop"]
    assert stopped, "no seed sampled <eos> in 300 tokens (chance ~0.05%)"
    seed = stopped[0]
    before = next(r for s, r in zip(seeds, outs) if s == seed)
    assert before.usage.completion_tokens < 300
    after = asyncio.run(sample([seed], True))[0]
    assert after.choices[0].finish_reason == "length" and after.usage.completion_tokens == 300
    assert after.choices[0].text.startswith(before.choices[0].text)


def test_logprobs_completions(client, greedy):
    choice, usage = complete(client, temperature=0, logprobs=3, max_tokens=8)
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and 1 <= len(top) <= 4
        assert math.isclose(value, max(top.values()), abs_tol=1e-5)  # greedy = the best
        assert token in top
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert choice.text == greedy.text[:len(choice.text)]


def test_logprobs_chat_stream(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
        temperature=0, logprobs=True, top_logprobs=2, stream=True)
    entries = [e for ch in stream if ch.choices and ch.choices[0].logprobs
               for e in ch.choices[0].logprobs.content]
    assert len(entries) == 6
    for e in entries:
        assert e.logprob <= 0 and len(e.top_logprobs) == 2 and e.bytes
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob


def test_penalties_change_output(client):
    base = complete(client, temperature=0, max_tokens=24)[0].text
    for kw in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0},
               {"extra_body": {"repetition_penalty": 2.0}}):
        assert complete(client, temperature=0, max_tokens=24, **kw)[0].text != base, kw


def test_temperature_changes_output(client, greedy):
    texts = {complete(client, temperature=2.0, seed=s)[0].text for s in range(3)}
    assert texts != {greedy.text} and len(texts) > 1
