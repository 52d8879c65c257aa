"""Tensor-parallel stages (`--tp 2`) through Ray end to end, on CPU (gloo): for tiny Llama,
Qwen3-MoE, DeepSeek-V3 and DeepSeek-V4 checkpoints at PP 1 and 2, requests of lengths around
each family's thresholds arriving staggered (prefill chunks and decode rows of different requests
share microbatches) give transformers' greedy tokens, over every skip mode and run-ahead on and
off; the host output channel and an abort mid-decode; seeded sampling gives the
tokens of the same engine without TP; and a rank killed mid-decode fails only the request in
flight, the rebuilt pipeline (all of the dead rank's stage and the others) serving the same
tokens again."""

from __future__ import annotations

import asyncio
import sys

import pytest

from app import Engine, EngineConfig, SamplingParams
from app.pipeline import STAGE_NAMESPACE
from tests.hf_reference import check_output_counts
from tests.ray.test_batch_invariance import CASES, CHUNK, MAX_NEW, _staggered, make_prompts
from tests.ray.test_output_channel import _AbortingEngine
from tests.ray.test_stage_failure import TIMEOUT, _prompt, _wait_for

TP = 2
# (case, pp, skip, run_ahead): each family at PP 1 and 2, the skip modes and run-ahead rotating
# make test runs each family once, with both PP sizes, every skip mode and run-ahead on and off
# among the four; `make test-slow` each family at its other PP size too
RUNS = [
    ("llama", 1, "off", False),
    ("llama", 2, "auto", True),
    ("qwen3_moe", 1, "sglang", True),
    ("qwen3_moe", 2, "off", False),
    ("ds_v3", 1, "auto", False),
    ("ds_v3", 2, "sglang", True),
    ("ds_v4", 1, "off", True),
    ("ds_v4", 2, "auto", False),
]
SLOW_RUNS = {RUNS[1], RUNS[3], RUNS[4], RUNS[6]}
MATRIX = [pytest.param(*r, marks=[pytest.mark.slow] if r in SLOW_RUNS else []) for r in RUNS]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tp-families")
    return {name: CASES[name].write(root) for name in {r[0] for r in RUNS}}


@pytest.fixture(scope="module")
def references(checkpoints):
    out = {}
    for name in checkpoints:
        prompts = make_prompts(CASES[name])
        out[name] = prompts, CASES[name].reference(checkpoints[name], prompts)
    return out


def config(path, pp, tp=TP, **kw) -> EngineConfig:
    base = dict(model=path, pp_size=pp, tp_size=tp, device="cpu", chunk_size=CHUNK,
                max_num_seqs=16, max_model_len=128, channel_check=True, stage_num_cpus=0.5,
                num_kv_blocks=256)
    return EngineConfig(**{**base, **kw})


@pytest.mark.parametrize("name,pp,skip,run_ahead", MATRIX)
def test_split_stages_give_transformers_tokens(ray_cluster, checkpoints, references, name, pp,
                                               skip, run_ahead):
    case, (prompts, reference) = CASES[name], references[name]
    cfg = config(checkpoints[name], pp, pp_output_skip=skip, run_ahead=run_ahead,
                 block_size=case.block_size)
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    with Engine(cfg) as engine:
        together = asyncio.run(_staggered(engine, prompts, greedy))
        stats = engine.stats()
        stages = engine.info["stages"]
    for i, p in enumerate(prompts):
        assert together[i] == reference[i], f"{name}: prompt {i} ({len(p)} tokens) staggered"
    assert stats["tp_size"] == TP and stats["prefix_cache_hits"] > 0
    check_output_counts(stats, skip, pp)
    assert [[r["tp_rank"] for r in s["ranks"]] for s in stages] == [[0, 1]] * pp
    for s in stages:  # a stage's ranks share a node (one bundle)
        assert len({r["node_id"] for r in s["ranks"]}) == 1


def test_host_channel_and_an_abort(ray_cluster, checkpoints, references):
    """Stage 0's ranks read the sampled ids from the plans (no output message at all); a
    request aborted mid-decode frees its blocks and the others go on."""
    ray_cluster.cloudpickle.register_pickle_by_value(sys.modules[_AbortingEngine.__module__])
    prompts, reference = references["qwen3_moe"]
    prompts, reference = prompts[-6:], reference[-6:]
    cfg = config(checkpoints["qwen3_moe"], 2, output_channel="host", block_size=4)
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    with _AbortingEngine(cfg) as engine:
        assert [o.token_ids for o in engine.generate(prompts, greedy)] == reference
        aborted = engine._actor.abort_one_mid_decode.remote(prompts, greedy)
        assert ray_cluster.get(aborted) == reference[1:]
        stats = engine.stats()
    assert stats["channel_output_sends"] == 0 and stats["kv_cache_usage"] == 0.0


@pytest.mark.slow
def test_seeded_sampling_as_without_tp(ray_cluster, checkpoints, references):
    """Every rank of the last stage samples the same token from the same logits and seed, so
    seeded sampling gives the tokens of the stage that is not split."""
    prompts = references["llama"][0][:6]
    params = [SamplingParams(max_tokens=MAX_NEW, temperature=1.0, seed=s) for s in range(6)]
    out = {}
    for tp in (1, TP):
        with Engine(config(checkpoints["llama"], 2, tp=tp, block_size=4)) as engine:
            out[tp] = [o.token_ids for o in engine.generate(prompts, params)]
    assert out[TP] == out[1]


def test_rank_killed_mid_decode(ray_cluster):
    """The built-in model at PP 2 x TP 2: rank 1 of the last stage killed while a request
    decodes. Only that request fails, with a clear error; the pipeline is rebuilt whole (every
    rank of every stage, next generation's names) and serves the same tokens."""
    ray = ray_cluster
    cfg = EngineConfig(pp_size=2, tp_size=TP, device="cpu", chunk_size=16, block_size=16,
                       max_num_seqs=2, stage_num_cpus=0.5, num_kv_blocks=256, channel_check=True)
    short = [_prompt(20, seed) for seed in (1, 2)]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with Engine(cfg) as engine:
        before = [o.token_ids for o in engine.generate(short, greedy)]
        pid = engine.stats()["pipeline_id"]
        names = [f"ppserve-{pid}-stage{i}-tp{r}" for i in range(2) for r in range(TP)]
        long_decode = SamplingParams(max_tokens=3000, temperature=0.0, ignore_eos=True)
        victim = engine._actor.generate_batch.remote([_prompt(30, 3)], [long_decode])
        _wait_for(engine, lambda s: s["num_running"] == 1, "the request to start")
        _wait_for(engine, lambda s: s["pp_output_comm"]["sent"] > 40, "the request to decode")
        ray.kill(ray.get_actor(names[3], namespace=STAGE_NAMESPACE), no_restart=True)
        [failed] = ray.get(victim, timeout=TIMEOUT)
        assert failed.finish_reason == "error" and "stage 1 of 2 stopped" in failed.error
        assert len(failed.token_ids) > 10  # it died while decoding
        after = [o.token_ids for o in engine.generate(short, greedy)]
        stats = engine.stats()
        for name in names:  # every rank rebuilt under the next generation's name
            ray.get_actor(name.replace(f"-{pid}-", f"-{pid}-g1-"), namespace=STAGE_NAMESPACE)
            with pytest.raises(ValueError):
                ray.get_actor(name, namespace=STAGE_NAMESPACE)
    assert after == before
    assert stats["pipeline_failures"] == 1 and stats["kv_cache_usage"] == 0
