"""Through Ray end to end on the tiny llama checkpoint: greedy tokens identical to transformers'
generate; posting the output recv late; on-demand KV admission; run-ahead decoding.

One Ray cluster and one checkpoint + transformers reference for all of them: the last three
sections were test_post_policies.py, test_kv_on_demand.py and test_run_ahead.py, which imported
this module's fixtures and so wrote and ran the same checkpoint and reference again each, and
started a cluster each (together 228 s before the merge, 189 s after, on 2 cores)."""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections import Counter

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


# -- posting the output recv late, and run-ahead on a single stage, still give transformers'
# greedy tokens (the other suites cover early posting at PP 2-3) (was test_post_policies.py) ------

@pytest.mark.parametrize("pp,skip,run_ahead,post", [
    (3, "off", False, "late"), (2, "auto", True, "late"), (1, "auto", True, "early")])
def test_policies_match_transformers(ray_cluster, checkpoint, prompts, reference,
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


# -- on-demand KV admission (--kv-admission on-demand) (was test_kv_on_demand.py): six concurrent
# requests on a pool barely larger than the longest one all complete, with preemption
# (recompute), the same greedy tokens as transformers and as the reserving engine, seeded
# sampling (penalties included) unchanged, and every block back in the pool. ---------------------

N = 6
LONG = 24  # tokens of the long runs: the longest prompt (64) + 24 = 22 blocks of 4


def _on_demand_cfg(checkpoint, kv_admission, num_blocks, run_ahead=False):
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
    with Engine(_on_demand_cfg(checkpoint, "reserve", 2048)) as engine:
        runs = _runs(engine, prompts[:N])
        assert engine.stats()["num_preemptions"] == 0
    return runs


@pytest.mark.parametrize("run_ahead", [False, True])
def test_tiny_pool_preempts_and_matches(ray_cluster, checkpoint, prompts, reference, reserved,
                                        run_ahead):
    assert max(len(p) for p in prompts[:N]) + LONG <= 24 * 4
    with Engine(_on_demand_cfg(checkpoint, "on-demand", 24, run_ahead)) as engine:
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


# -- run-ahead decoding (was test_run_ahead.py): a request's step t+1 leaves before token t is
# back on the host (stage 0 reads it from the output channel). Same tokens as transformers'
# generate, stops in flight orphan their send and leak nothing, seeded sampling unchanged. -------

CHUNK = 7  # budget 7 tokens: 16 decoding requests span 3 microbatches, so groups form


def _run_ahead_cfg(checkpoint, pp, skip, run_ahead, budget=None):
    # max_inflight: None -> 2 x pp with run_ahead, so a step t+1 can leave while t is in flight
    return EngineConfig(model=checkpoint, pp_size=pp, device="cpu", chunk_size=CHUNK,
                        max_num_batched_tokens=budget,
                        pp_output_skip=skip, block_size=4, max_num_seqs=16, max_model_len=256,
                        channel_check=True, stage_num_cpus=0.5, num_kv_blocks=2048,
                        run_ahead=run_ahead)


# make test runs each PP size once and both skip modes; `make test-slow` the other three
RUN_AHEAD_FAST = [("auto", 1), ("off", 2), ("auto", 3)]


@pytest.mark.parametrize(
    "skip,pp",
    [
        pytest.param(s, p, marks=[] if (s, p) in RUN_AHEAD_FAST else [pytest.mark.slow])
        for s in ("off", "auto")
        for p in (1, 2, 3)
    ],
)
def test_run_ahead_greedy_matches_transformers(ray_cluster, checkpoint, prompts, reference, pp,
                                               skip):
    assert _run_ahead_cfg(checkpoint, pp, skip, True).inflight == (3 if pp == 1 else 2 * pp)
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    with Engine(_run_ahead_cfg(checkpoint, pp, skip, True)) as engine:
        outs = engine.generate(prompts, greedy)
        assert [o.token_ids for o in outs] == reference
        stats = engine.stats()
    comm = stats["pp_output_comm"]
    if skip == "auto":
        assert comm["missed"] == 0
    else:
        assert comm["skipped"] == 0
    # PP=1 has no channel: its "sends" are local scatters of the sampled ids
    assert stats["channel_output_sends"] == (comm["sent"] if pp > 1 else 0)
    assert stats["kv_cache_usage"] == 0.0


def _stop_token(reference):
    """A token the greedy continuations produce early (not at their end), EOS aside."""
    early = Counter(t for ref in reference for t in dict.fromkeys(ref[:MAX_NEW - 2]) if t != 2)
    return early.most_common(1)[0][0]


@pytest.fixture(scope="module")
def runs(ray_cluster, checkpoint, prompts, reference):
    """Per run_ahead setting: stop-token outputs and counters, seeded outputs, final stats.
    One token a microbatch: each decode step rides alone, so a stopped request's step in flight
    is an orphaned send (a microbatch counts as orphaned only if none of its tokens is read)."""
    stop = SamplingParams(max_tokens=MAX_NEW, temperature=0.0,
                          stop_token_ids=[_stop_token(reference)])
    seeded = SamplingParams(max_tokens=MAX_NEW, temperature=0.9, top_p=0.95, seed=1234,
                            ignore_eos=True)
    out = {}
    for run_ahead in (False, True):
        with Engine(_run_ahead_cfg(checkpoint, 2, "auto", run_ahead, budget=1)) as engine:
            stopped = engine.generate(prompts, stop)
            after_stop = engine.stats()
            sampled = engine.generate(prompts, seeded)
            greedy = engine.generate(prompts, SamplingParams(max_tokens=MAX_NEW,
                                                             temperature=0.0))
            out[run_ahead] = dict(stopped=stopped, after_stop=after_stop, sampled=sampled,
                                  greedy=greedy, final=engine.stats())
    return out


def test_stop_in_flight_orphans_a_send_and_breaks_nothing(runs, reference):
    ahead, plain = runs[True], runs[False]
    stop_id = _stop_token(reference)
    hits = 0
    for o, p, ref in zip(ahead["stopped"], plain["stopped"], reference):
        assert o.token_ids == p.token_ids == ref[:len(o.token_ids)]
        assert o.finish_reason == p.finish_reason
        if stop_id in ref[:-1] and 2 not in ref[:ref.index(stop_id)]:
            hits += 1
            assert o.finish_reason == "stop" and len(o.token_ids) < MAX_NEW
    assert hits > 0
    comm = ahead["after_stop"]["pp_output_comm"]
    assert comm["orphaned"] > 0 and comm["missed"] == 0
    assert ahead["after_stop"]["channel_output_sends"] == comm["sent"]
    assert ahead["after_stop"]["kv_cache_usage"] == 0.0  # the pool is full again
    # the pipeline carries on: later requests still match transformers
    assert [o.token_ids for o in ahead["greedy"]] == reference
    assert ahead["final"]["kv_cache_usage"] == 0.0
    assert ahead["final"]["channel_output_sends"] == ahead["final"]["pp_output_comm"]["sent"]


def test_seeded_sampling_is_the_same_with_and_without_run_ahead(runs):
    tokens = {k: [o.token_ids for o in r["sampled"]] for k, r in runs.items()}
    assert tokens[True] == tokens[False]
    assert all(len(t) == MAX_NEW for t in tokens[True])


def test_one_stage_collects_after_the_next_launch(ray_cluster, checkpoint, prompts, reference):
    """PP=1 with run-ahead: each step's result is collected after the next step is launched.
    Penalties read the earlier tokens, so their steps are finished first: same tokens as
    without run-ahead, greedy, seeded and penalised, alone and batched; a stop in flight and
    the next requests are unaffected."""
    penalised = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, repetition_penalty=1.3,
                               presence_penalty=0.5, frequency_penalty=0.3)
    seeded = SamplingParams(max_tokens=MAX_NEW, temperature=0.9, top_p=0.95, seed=7,
                            ignore_eos=True)
    stop = SamplingParams(max_tokens=MAX_NEW, temperature=0.0,
                          stop_token_ids=[_stop_token(reference)])
    out = {}
    for run_ahead in (False, True):
        # the run-ahead engine also streams with --stream-interval 3 (its own test below)
        cfg = dataclasses.replace(_run_ahead_cfg(checkpoint, 1, "auto", run_ahead),
                                  stream_interval=3 if run_ahead else 1)
        with Engine(cfg) as engine:
            out[run_ahead] = [[o.token_ids for o in engine.generate(prompts, p)]
                              for p in (penalised, seeded, stop)]
            out[run_ahead].append([engine.generate([q], penalised)[0].token_ids
                                   for q in prompts[:2]])
            greedy = engine.generate(prompts, SamplingParams(max_tokens=MAX_NEW,
                                                             temperature=0.0))
            assert [o.token_ids for o in greedy] == reference
            if run_ahead:
                _check_streams_of_three(engine, prompts, reference)
            assert engine.stats()["kv_cache_usage"] == 0.0
    assert out[True] == out[False]
    assert out[True][0] != reference  # the penalties changed the greedy tokens


def _check_streams_of_three(engine, prompts, reference):
    """--stream-interval 3, every request streamed at once: each stream's first delta is its
    first token alone, the others carry 3 tokens or more (a consumer behind gets them merged),
    and the tokens are transformers'."""
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)

    async def deltas(prompt):
        return [d async for d in engine.stream(prompt, greedy)]

    async def every():
        return await asyncio.gather(*[deltas(p) for p in prompts])

    streams = asyncio.run(every())
    assert [[t for d in s for t in d.token_ids] for s in streams] == reference
    for s in streams:
        assert len(s[0].token_ids) == 1 and s[0].prompt_token_ids is not None
        assert all(len(d.token_ids) >= 3 for d in s[1:-1]) and s[-1].finished
    assert any(len(s) > 2 for s in streams)  # grouped, not one delta for the whole output
