"""Posting the output recv late, and run-ahead on a single stage, still give transformers'
greedy tokens (the other suites cover early posting at PP 2-3)."""

from __future__ import annotations

import pytest

from app import Engine, EngineConfig, SamplingParams
from tests.ray.test_engine_vs_hf import MAX_NEW, checkpoint, prompts, reference  # noqa: F401


@pytest.mark.parametrize("pp,skip,run_ahead,post", [
    (3, "off", False, "late"), (2, "auto", True, "late"), (1, "auto", True, "early")])
def test_policies_match_transformers(ray_cluster, checkpoint, prompts, reference,  # noqa: F811
                                     pp, skip, run_ahead, post):
    cfg = EngineConfig(model=checkpoint, pp_size=pp, device="cpu", chunk_size=7,
                       pp_output_skip=skip, output_post=post, run_ahead=run_ahead,
                       block_size=4, max_num_seqs=16, max_model_len=256, channel_check=True,
                       stage_num_cpus=0.5, num_kv_blocks=2048)
    with Engine(cfg) as engine:
        outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0.0))
        stats = engine.stats()
    assert [o.token_ids for o in outs] == reference
    if pp > 1:
        assert stats["channel_output_sends"] == stats["pp_output_comm"]["sent"]
    assert stats["kv_cache_usage"] == 0.0
