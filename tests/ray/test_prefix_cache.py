"""Prefix caching through Ray (docs/ARCHITECTURE.md#kv-cache): requests that start after a cached
prefix give the same greedy tokens as transformers and as an engine without the cache, for PP 1/2/3,
with prefixes ending inside and at block boundaries, concurrent requests sharing a prefix still
being prefilled, and eviction in a pool too small to keep everything; the hit counts in
stats() are exactly the full blocks a request shares with what ran before it."""

from __future__ import annotations

import random

import pytest

from app import Engine, EngineConfig, SamplingParams
from tests.cpu.conftest import write_tiny_checkpoint
from tests.hf_reference import tiny_reference

MAX_NEW = 6
BS = 4
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), "llama")


def _tokens(rng, n):
    return [rng.randrange(3, 200) for _ in range(n)]


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(11)
    head = _tokens(rng, 40)  # 10 blocks of 4
    other = _tokens(rng, 30)
    return {
        "a": head + _tokens(rng, 5),
        "at_boundary": head + _tokens(rng, 3),  # shares exactly 10 blocks with a
        "inside": head[:38] + _tokens(rng, 9),  # shares 38 tokens: 9 full blocks
        "head_only": list(head),  # all cached but its last token: 9 blocks
        "other": other + _tokens(rng, 4),
        **{f"c{i}": other + _tokens(rng, 2 + i) for i in range(4)},  # concurrent sharers
    }


@pytest.fixture(scope="module")
def sequential(prompts):
    order = ["a", "at_boundary", "inside", "head_only", "a", "other"]
    return [(name, prompts[name]) for name in order]


@pytest.fixture(scope="module")
def reference(prompts):
    return dict(zip(prompts, tiny_reference("llama", list(prompts.values()), MAX_NEW)))


def _cfg(checkpoint, pp, caching=True, num_blocks=2048, chunk=8, admission="reserve"):
    return EngineConfig(model=checkpoint, pp_size=pp, device="cpu", chunk_size=chunk,
                        block_size=BS, max_num_seqs=8, max_model_len=256, channel_check=True,
                        stage_num_cpus=0.5, num_kv_blocks=num_blocks,
                        enable_prefix_caching=caching, kv_admission=admission)


def _expected_hits(seqs):
    """Cached tokens of each prompt run one after another with nothing evicted: the full
    blocks it shares with an earlier prompt, never its last token."""
    hits = []
    for i, p in enumerate(seqs):
        best = 0
        for q in seqs[:i]:
            n = 0
            while n < min(len(p), len(q)) and p[n] == q[n]:
                n += 1
            best = max(best, n)
        hits.append(min(best, len(p) - 1) // BS * BS)
    return hits


@pytest.mark.parametrize("pp", [1, 2, 3])
def test_cache_hits_match_transformers(ray_cluster, checkpoint, prompts, sequential,
                                       reference, pp):
    seqs = [p for _, p in sequential]
    with Engine(_cfg(checkpoint, pp)) as engine:
        seen = []
        for name, p in sequential:  # one at a time: each sees what the earlier ones left
            before = engine.stats()["prefix_cache_hits"]
            (out,) = engine.generate([p], GREEDY)
            assert out.token_ids == reference[name], name
            seen.append(engine.stats()["prefix_cache_hits"] - before)
        concurrent = [f"c{i}" for i in range(4)]
        outs = engine.generate([prompts[n] for n in concurrent], GREEDY)
        assert [o.token_ids for o in outs] == [reference[n] for n in concurrent]
        stats = engine.stats()
    assert seen == _expected_hits(seqs)
    assert seen[1] == 40 and seen[2] == 36 and seen[3] == 36 and seen[4] == 44
    assert stats["prefix_cache_queries"] == sum(map(len, seqs)) + sum(
        len(prompts[n]) for n in concurrent)
    assert stats["kv_cache_usage"] == 0.0 and stats["kv_blocks_cached"] > 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_same_tokens_as_without_the_cache_concurrent_and_seeded(ray_cluster, checkpoint,
                                                                prompts, reference):
    """Sharers arrive together while their common prefix is still being prefilled (chunks of
    8 on 2 stages), then again once it is cached; seeded sampling gives the same tokens."""
    names = [f"c{i}" for i in range(4)] + ["other"]
    batch = [prompts[n] for n in names]
    seeded = [SamplingParams(max_tokens=MAX_NEW, temperature=0.9, seed=5 + i, ignore_eos=True,
                             repetition_penalty=1.2) for i in range(len(batch))]
    runs = {}
    for caching in (False, True):
        with Engine(_cfg(checkpoint, 2, caching)) as engine:
            first = [o.token_ids for o in engine.generate(batch, GREEDY)]
            again = [o.token_ids for o in engine.generate(batch, GREEDY)]
            sampled = [o.token_ids for o in engine.generate(batch, seeded)]
            stats = engine.stats()
        runs[caching] = (first, again, sampled)
        assert first == again == [reference[n] for n in names]
        assert (stats["prefix_cache_hits"] > 0) == caching
    assert runs[True] == runs[False]


@pytest.mark.parametrize("admission", ["reserve", "on-demand"])
def test_eviction_under_pressure(ray_cluster, checkpoint, prompts, reference, admission):
    """A pool of 30 blocks of 4 keeps about two prompts: the cache evicts to admit new ones,
    hits what survives, and never hands a block in use to another request."""
    names = ["a", "other", "at_boundary", "c0", "inside", "a", "c1", "head_only"]
    with Engine(_cfg(checkpoint, 2, num_blocks=30, admission=admission)) as engine:
        for name in names:
            (out,) = engine.generate([prompts[name]], GREEDY)
            assert out.token_ids == reference[name], name
        outs = engine.generate([prompts[n] for n in names], GREEDY)
        assert [o.token_ids for o in outs] == [reference[n] for n in names]
        stats = engine.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] == 30
    assert 0 < stats["prefix_cache_hits"] < stats["prefix_cache_queries"]
    assert stats["kv_blocks_cached"] <= 30


def test_prefix_caching_is_on_by_default():
    assert EngineConfig().enable_prefix_caching is True
    assert EngineConfig(enable_prefix_caching=False).scheduler_config(
        64, 256, None).enable_prefix_caching is False
