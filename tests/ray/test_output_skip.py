"""The skip is real: the channel counts its own sends, and the modes differ as
docs/ARCHITECTURE.md#the-skip-rule says."""

from __future__ import annotations

import random

import pytest

from app import Engine, EngineConfig, SamplingParams

LONG = 300  # tokens; chunks of 32 -> 10 chunks, 9 of them mid-prompt


def _prompts(n, length, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(0, 256) for _ in range(length)] for _ in range(n)]


def _run(skip, prompts, max_tokens=4, budget=None):
    cfg = EngineConfig(pp_size=2, device="cpu", chunk_size=32, pp_output_skip=skip,
                       max_num_batched_tokens=budget, channel_check=True, block_size=16,
                       max_num_seqs=8, stage_num_cpus=0.5, num_kv_blocks=512)
    with Engine(cfg) as engine:
        outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                       ignore_eos=True))
        stats = engine.stats()
    return [o.token_ids for o in outs], stats


@pytest.fixture(scope="module")
def lone(ray_cluster):
    prompts = _prompts(1, LONG)
    return {mode: _run(mode, prompts) for mode in ("off", "sglang", "auto")}


def test_channel_counts_its_sends(lone):
    for mode, (_tokens, stats) in lone.items():
        assert stats["channel_output_sends"] == stats["pp_output_comm"]["sent"], mode


def test_auto_skips_mid_prompt_chunks_and_misses_nothing(lone):
    comm = lone["auto"][1]["pp_output_comm"]
    assert comm["skipped"] >= LONG // 32 - 1  # every mid-prompt chunk
    assert comm["missed"] == 0


def test_off_sends_everything_and_misses(lone):
    comm = lone["off"][1]["pp_output_comm"]
    assert comm["skipped"] == 0
    assert comm["missed"] >= LONG // 32 - 1


def test_modes_give_the_same_tokens(lone):
    assert lone["off"][0] == lone["sglang"][0] == lone["auto"][0]


def test_sglang_misses_where_auto_skips_on_concurrent_long_prompts(ray_cluster):
    # Four long prompts batched together: multi-request prefill microbatches, which the PR's
    # rule never skips and `auto` does.
    prompts = _prompts(4, 200, seed=1)
    tokens_s, sglang = _run("sglang", prompts, budget=128)
    tokens_a, auto = _run("auto", prompts, budget=128)
    assert tokens_s == tokens_a
    assert sglang["pp_output_comm"]["missed"] > 0
    assert auto["pp_output_comm"]["missed"] == 0
    assert auto["pp_output_comm"]["skipped"] > sglang["pp_output_comm"]["skipped"]
    for stats in (sglang, auto):
        assert stats["channel_output_sends"] == stats["pp_output_comm"]["sent"]
