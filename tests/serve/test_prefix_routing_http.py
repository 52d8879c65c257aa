"""Prefix-aware routing over real HTTP with two pipelines (Serve replicas): requests sharing a
long prefix land on one pipeline and hit its prefix cache; distinct prompts spread over both.
Where each request went is read from each pipeline's own metrics (the `pipeline` label)."""

from __future__ import annotations

import httpx
import pytest

from tests.serve.conftest import ENGINE_ARGS, start_cluster, stop_cluster, wait_for

MODEL = "ppserve-random"
BLOCK = ENGINE_ARGS["block_size"]
DOC = "A shared document that every question below is asked about, at some length. " * 4


@pytest.fixture(scope="module")
def served(fast_metrics):
    args = {**ENGINE_ARGS, "pp": 1, "num_replicas": 2}
    try:
        yield start_cluster({"ppserve": ("/", args)})
    finally:
        stop_cluster()


def per_pipeline(served, name: str) -> dict[str, float]:
    """{pipeline id: value} of one ppserve counter, summed over Ray's own labels."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(served.metrics_url, timeout=10).text
    except httpx.HTTPError:
        return {}
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                pipe = s.labels["pipeline"]
                out[pipe] = out.get(pipe, 0.0) + s.value
    return out


def successes_once_exported(served, total: int) -> dict[str, float]:
    """Per-pipeline finished requests, once all `total` show up in the export."""
    name = "ray_ppserve_request_success_total"
    got = wait_for(lambda: (c := per_pipeline(served, name)) and sum(c.values()) >= total and c,
                   timeout=60)
    assert got and sum(got.values()) == total, got
    return got


def complete(served, prompt: str) -> None:
    r = served.client().completions.create(model=MODEL, prompt=prompt, max_tokens=2,
                                           temperature=0)
    assert r.usage.prompt_tokens == len(prompt.encode()) + 1  # the byte tokenizer, BOS


def test_distinct_prompts_spread_then_a_shared_prefix_sticks_to_one_pipeline(served):
    distinct = [f"{i} unrelated prompt number {i}, long enough for a few blocks. " * 2
                for i in range(4)]
    for prompt in distinct:
        complete(served, prompt)
    before = successes_once_exported(served, len(distinct))
    assert len(before) == 2 and min(before.values()) >= 1, before  # both pipelines served

    hits_name = "ray_ppserve_prefix_cache_hits_total"
    hits_before = per_pipeline(served, hits_name)
    questions = ["What is it about?", "Who wrote it?", "Summarize it.", "Is it long?"]
    for q in questions:
        complete(served, DOC + q)
    after = successes_once_exported(served, len(distinct) + len(questions))
    gained = {p: after.get(p, 0) - before.get(p, 0) for p in after}
    holder = max(gained, key=lambda p: gained[p])
    assert gained[holder] == len(questions), gained  # every question on one pipeline

    # The later questions reused the document's KV there: at least its full blocks, each time.
    shared = (len(DOC.encode()) + 1) // BLOCK * BLOCK
    want = (len(questions) - 1) * shared

    def hits_gained():
        h = per_pipeline(served, hits_name)
        return {p: h.get(p, 0) - hits_before.get(p, 0) for p in h}

    got = wait_for(lambda: (g := hits_gained()).get(holder, 0) >= want and g, timeout=30)
    assert got and got[holder] >= want, (got, want)
    others = [p for p in got if p != holder]
    assert all(got[p] == 0 for p in others), got
