"""On-demand KV admission through Ray (--kv-admission on-demand): six concurrent requests on a
pool barely larger than the longest one all complete, with preemption (recompute), the same
greedy tokens as transformers and as the reserving engine, seeded sampling (penalties
included) unchanged, and every block back in the pool."""

from __future__ import annotations

import pytest

from app import Engine, EngineConfig, SamplingParams
from tests.ray.test_engine_vs_hf import MAX_NEW, checkpoint, prompts, reference  # noqa: F401

N = 6
LONG = 24  # tokens of the long runs: the longest prompt (64) + 24 = 22 blocks of 4


def _cfg(checkpoint, kv_admission, num_blocks, run_ahead=False):
    return EngineConfig(model=checkpoint, pp_size=2, device="cpu", chunk_size=16,
                        block_size=4, max_num_seqs=8, max_model_len=256, channel_check=True,
                        stage_num_cpus=0.5, num_kv_blocks=num_blocks, run_ahead=run_ahead,
                        kv_admission=kv_admission)


def _runs(engine, prompts):
    greedy = engine.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0.0))
    long = engine.generate(prompts, SamplingParams(max_tokens=LONG, temperature=0.0,
                                                   ignore_eos=True))
    seeded = engine.generate(prompts, [SamplingParams(
        max_tokens=LONG, temperature=0.9, seed=40 + i, ignore_eos=True, presence_penalty=0.5,
        frequency_penalty=0.3, repetition_penalty=1.2) for i in range(len(prompts))])
    return [[o.token_ids for o in outs] for outs in (greedy, long, seeded)]


@pytest.fixture(scope="module")
def reserved(ray_cluster, checkpoint, prompts):
    with Engine(_cfg(checkpoint, "reserve", 2048)) as engine:
        runs = _runs(engine, prompts[:N])
        assert engine.stats()["num_preemptions"] == 0
    return runs


@pytest.mark.parametrize("run_ahead", [False, True])
def test_tiny_pool_preempts_and_matches(ray_cluster, checkpoint, prompts, reference, reserved,
                                        run_ahead):
    assert max(len(p) for p in prompts[:N]) + LONG <= 24 * 4
    with Engine(_cfg(checkpoint, "on-demand", 24, run_ahead)) as engine:
        greedy, long, seeded = _runs(engine, prompts[:N])
        stats = engine.stats()
    assert greedy == reference[:N]
    assert [greedy, long, seeded] == reserved
    assert stats["num_preemptions"] > 0
    assert stats["kv_blocks_total"] == 24 and stats["kv_blocks_free"] == 24
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["pp_output_comm"]["missed"] == 0


def test_reserve_is_the_default_and_bad_values_are_refused():
    assert EngineConfig().kv_admission == "reserve"
    with pytest.raises(ValueError):
        EngineConfig(kv_admission="lazy")
