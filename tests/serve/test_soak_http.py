"""Soak over real HTTP: PPSERVE_SOAK_REQUESTS (256) concurrent streaming requests on the built-in
model, prompts of 1-2K tokens, 1-64 outputs each. All finish, each equals the same request run
alone (greedy), no KV block or stage slot is left taken, and the Prometheus request and token
counters equal what was sent. Marked slow: `make soak` runs it (minutes on 2 cores)."""

from __future__ import annotations

import asyncio
import os
import random
import time

import pytest

from tests.serve.conftest import start_cluster, stop_cluster, wait_for
from tests.serve.flood import flood, sequential
from tests.serve.test_metrics_http import scrape, value

pytestmark = pytest.mark.slow

N = int(os.environ.get("PPSERVE_SOAK_REQUESTS", "256"))
MAX_SEQS = 64
SOAK_ARGS = {"pp": 2, "max_model_len": 2112, "chunk_size": 256, "block_size": 16,
             "max_num_seqs": MAX_SEQS, "channel_check": True}


def bodies() -> list[dict]:
    """Byte-level tokenizer: a prompt of k ASCII characters is k tokens (+ BOS)."""
    rng = random.Random(256)
    words = ["pipeline", "stage", "chunk", "token", "decode", "prefill", "ray", "cache", "kv"]
    out = []
    for _ in range(N):
        text = ""
        target = rng.randint(1000, 2000)
        while len(text) < target:
            text += rng.choice(words) + " "
        out.append({"prompt": text[:target], "max_tokens": rng.randint(1, 64), "temperature": 0,
                    "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}})
    return out


@pytest.fixture(scope="module")
def served(fast_metrics):
    try:
        yield start_cluster({"ppserve": ("/", SOAK_ARGS)})
    finally:
        stop_cluster()


def test_soak(served):
    reqs = bodies()
    start = time.monotonic()
    replies = asyncio.run(flood(served.base_url, reqs))
    soak_s = time.monotonic() - start
    start = time.monotonic()
    alone = asyncio.run(sequential(served.base_url, reqs))
    alone_s = time.monotonic() - start
    wrong = [i for i, (r, a, b) in enumerate(zip(replies, alone, reqs))
             if not (r.status == 200 and r.done and r.error is None
                     and r.finish_reason == "length" and r.completion_tokens == b["max_tokens"]
                     and r.text == a.text)]
    assert not wrong, [(i, replies[i]) for i in wrong[:3]]
    assert all(a.status == 200 and a.completion_tokens == b["max_tokens"]
               for a, b in zip(alone, reqs))
    stats = served.stats()
    assert stats["num_running"] == stats["num_waiting"] == stats["inflight_microbatches"] == 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert stats["slots_free"] == MAX_SEQS

    sent = 2 * N  # the concurrent run and the sequential one
    tokens = 2 * sum(b["max_tokens"] for b in reqs)
    samples = wait_for(lambda: (s := scrape(served)) and value(
        s, "ray_ppserve_generation_tokens_total") == tokens and value(
        s, "ray_ppserve_request_success_total") == sent and s, timeout=60)
    assert samples, scrape(served)
    assert value(samples, "ray_ppserve_request_success_total", finished_reason="length") == sent
    assert value(samples, "ray_ppserve_e2e_request_latency_seconds_count") == sent
    prompt_tokens = value(samples, "ray_ppserve_prompt_tokens_total")
    assert prompt_tokens % 2 == 0 and prompt_tokens / 2 >= sum(len(b["prompt"]) for b in reqs)
    print(f"soak: {N} concurrent streams in {soak_s:.1f} s, the same {N} one at a time in "
          f"{alone_s:.1f} s; prompt tokens {int(prompt_tokens // 2)}, output tokens "
          f"{tokens // 2}; preemptions {stats['num_preemptions']}; pool "
          f"{stats['kv_blocks_free']}/{stats['kv_blocks_total']} blocks free, "
          f"{stats['slots_free']}/{MAX_SEQS} slots free")
