"""Run-ahead decoding through Ray: a request's step t+1 leaves before token t is back on the
host (stage 0 reads it from the output channel). Same tokens as transformers' generate, stops
in flight orphan their send and leak nothing, seeded sampling unchanged."""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import replace

import pytest

from app import Engine, EngineConfig, SamplingParams
from tests.ray.test_engine_vs_hf import MAX_NEW, checkpoint, prompts, reference  # noqa: F401

CHUNK = 7  # budget 7 tokens: 16 decoding requests span 3 microbatches, so groups form


def _cfg(checkpoint, pp, skip, run_ahead, budget=None):
    # max_inflight: None -> 2 x pp with run_ahead, so a step t+1 can leave while t is in flight
    return EngineConfig(model=checkpoint, pp_size=pp, device="cpu", chunk_size=CHUNK,
                        max_num_batched_tokens=budget,
                        pp_output_skip=skip, block_size=4, max_num_seqs=16, max_model_len=256,
                        channel_check=True, stage_num_cpus=0.5, num_kv_blocks=2048,
                        run_ahead=run_ahead)


@pytest.mark.parametrize("pp", [1, 2, 3])
@pytest.mark.parametrize("skip", ["off", "auto"])
def test_greedy_matches_transformers(ray_cluster, checkpoint, prompts, reference, pp, skip):
    assert _cfg(checkpoint, pp, skip, True).inflight == (3 if pp == 1 else 2 * pp)
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    with Engine(_cfg(checkpoint, pp, skip, True)) as engine:
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
        with Engine(_cfg(checkpoint, 2, "auto", run_ahead, budget=1)) as engine:
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
        cfg = replace(_cfg(checkpoint, 1, "auto", run_ahead), stream_interval=3 if run_ahead else 1)
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
