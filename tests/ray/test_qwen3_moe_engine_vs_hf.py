"""Qwen3-MoE through Ray end to end: greedy tokens identical to transformers' generate, alone and
batched, with prefix-cache hits.

The default run takes one case per PP size (odd chunks, every skip mode met once, both tiny
checkpoints); the slow matrix runs every PP size x chunk size x skip mode on each checkpoint.
"""

from __future__ import annotations

import itertools
import random

import pytest

from app import Engine, EngineConfig, SamplingParams
from tests.cpu.conftest import QWEN3_MOE_ARCHS, write_tiny_checkpoints
from tests.hf_reference import check_output_counts, tiny_reference

MAX_NEW = 6
BS = 4
SKIPS = ("off", "sglang", "auto")
CHUNKS = (5, 13)
FAST = [
    ("qwen3_moe", 1, 5, "sglang"),
    ("qwen3_moe_step2", 2, 13, "auto"),
    ("qwen3_moe", 3, 5, "off"),
]
FULL = [
    case
    for case in itertools.product(QWEN3_MOE_ARCHS, (1, 2, 3), CHUNKS, SKIPS)
    if case not in FAST
]
SHARED = 21  # prompts 0 and 3 share this many tokens: 5 full blocks of 4 are a cache hit


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return write_tiny_checkpoints(tmp_path_factory.mktemp("qwen3-moe-ckpt"), QWEN3_MOE_ARCHS)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(5)
    head = [rng.randrange(3, 200) for _ in range(24)]
    rest = [[rng.randrange(3, 200) for _ in range(n)] for n in (5, 9, 1, 10, 31, 2)]
    return [head + rest[0], rest[1], rest[2], head[:SHARED] + rest[3], rest[4], head + rest[5]]


@pytest.fixture(scope="module")
def references(prompts):
    return {arch: tiny_reference(arch, prompts, MAX_NEW) for arch in QWEN3_MOE_ARCHS}


def _check(checkpoints, prompts, references, arch, pp, chunk, skip):
    reference = references[arch]
    cfg = EngineConfig(
        model=checkpoints[arch],
        pp_size=pp,
        device="cpu",
        chunk_size=chunk,
        pp_output_skip=skip,
        block_size=BS,
        max_num_seqs=8,
        max_model_len=256,
        channel_check=True,
        stage_num_cpus=0.5,
        num_kv_blocks=512,
    )
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    with Engine(cfg) as engine:
        hits = []
        for i in (0, 3):  # alone; the second starts after the first's cached blocks
            before = engine.stats()["prefix_cache_hits"]
            (out,) = engine.generate([prompts[i]], greedy)
            assert out.token_ids == reference[i]
            hits.append(engine.stats()["prefix_cache_hits"] - before)
        assert hits == [0, SHARED // BS * BS]
        outs = engine.generate(prompts, greedy)  # batched: decode rows beside chunks
        assert [o.token_ids for o in outs] == reference
        stats = engine.stats()
    check_output_counts(stats, skip, pp)


@pytest.mark.parametrize("arch,pp,chunk,skip", FAST)
def test_greedy_matches_transformers(
    ray_cluster, checkpoints, prompts, references, arch, pp, chunk, skip
):
    _check(checkpoints, prompts, references, arch, pp, chunk, skip)


@pytest.mark.slow
@pytest.mark.parametrize("arch,pp,chunk,skip", FULL)
def test_greedy_matches_transformers_every_combination(
    ray_cluster, checkpoints, prompts, references, arch, pp, chunk, skip
):
    _check(checkpoints, prompts, references, arch, pp, chunk, skip)
