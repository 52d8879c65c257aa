"""Through Ray end to end: greedy tokens identical to transformers' generate."""

from __future__ import annotations

import dataclasses
import random

import pytest

from app import Engine, EngineConfig, SamplingParams
from tests.cpu.conftest import write_tiny_checkpoint
from tests.hf_reference import check_output_counts, tiny_reference

MAX_NEW = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), "llama")


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(7)
    return [[rng.randrange(3, 200) for _ in range(n)]
            for n in [5, 13, 29, 41, 1, 64, 17, 33, 8, 50, 21, 3, 37, 12, 45, 26]]


@pytest.fixture(scope="module")
def reference(prompts):
    return tiny_reference("llama", prompts, MAX_NEW)


def _cfg(checkpoint, pp, chunk, skip):
    return EngineConfig(model=checkpoint, pp_size=pp, device="cpu", chunk_size=chunk,
                        pp_output_skip=skip, block_size=4, max_num_seqs=16, max_model_len=256,
                        channel_check=True, stage_num_cpus=0.5, num_kv_blocks=2048)


# make test runs six of the 18 (skip, chunk, pp) cases: every (chunk, pp) and (skip, chunk) pair
# and each skip mode at two PP sizes; `make test-slow` runs the rest.
FAST = [("auto", 7, 3), ("off", 7, 2), ("sglang", 7, 1), ("sglang", 256, 3), ("auto", 256, 2),
        ("off", 256, 1)]
MATRIX = FAST + [pytest.param(s, c, p, marks=pytest.mark.slow)
                 for s in ("off", "sglang", "auto") for c in (7, 256) for p in (1, 2, 3)
                 if (s, c, p) not in FAST]


@pytest.mark.parametrize("skip,chunk,pp", MATRIX)
def test_greedy_matches_transformers(ray_cluster, checkpoint, prompts, reference, pp, chunk,
                                     skip):
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    with Engine(_cfg(checkpoint, pp, chunk, skip)) as engine:
        # single requests, one after another
        for p, ref in list(zip(prompts, reference))[:3]:
            (out,) = engine.generate([p], greedy)
            assert out.token_ids == ref
        # 16 concurrent requests of mixed lengths
        outs = engine.generate(prompts, greedy)
        assert [o.token_ids for o in outs] == reference
        for o, ref in zip(outs, reference):
            assert o.finish_reason == ("stop" if len(ref) < MAX_NEW or ref[-1] == 2 else "length")
        check_output_counts(engine.stats(), skip, pp)


def test_dynamic_chunking_matches_transformers(ray_cluster, checkpoint, prompts, reference):
    """Chunks that shrink as the prefix grows leave greedy tokens unchanged, alone and 16
    concurrent; the lone prompt runs in exactly the scheduler's planned chunks."""
    from app.scheduler import ChunkCost
    from stages.model_config import load_model_args

    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    cfg = dataclasses.replace(_cfg(checkpoint, 2, 16, "auto"), enable_dynamic_chunking=True,
                              dynamic_chunk_smooth=1.0)
    plan = cfg.scheduler_config(num_blocks=1, max_model_len=64,
                                chunk_cost=ChunkCost.for_model(load_model_args(checkpoint)))
    chunks, prefix = 0, 0
    while prefix < 64:
        prefix += plan.chunk_limit(prefix)
        chunks += 1
    assert chunks > 64 // 16
    with Engine(cfg) as engine:
        (out,) = engine.generate([prompts[5]], greedy)  # 64 tokens
        assert out.token_ids == reference[5] and len(out.token_ids) == MAX_NEW
        comm = engine.stats()["pp_output_comm"]  # every microbatch is sent or skipped
        assert comm["sent"] + comm["skipped"] == chunks + MAX_NEW - 1, comm
        outs = engine.generate(prompts, greedy)
        assert [o.token_ids for o in outs] == reference
        assert engine.stats()["pp_output_comm"]["missed"] == 0
