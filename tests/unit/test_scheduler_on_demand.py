"""On-demand KV admission (kv_admission="on-demand"): admit on the prompt's blocks, grow
lazily, preempt the youngest (recompute) when blocks run out; nothing leaks or deadlocks."""

import random

import pytest

from app.scheduler import SchedRequest, Scheduler
from stages.protocol import SamplingSpec
from tests.unit.scheduler_configs import scheduler_config
from tests.unit.scheduler_driver import drive


def make(kv_admission="on-demand", **kw):
    args = dict(chunk_size=8, max_num_batched_tokens=16, max_num_seqs=4, max_inflight=1,
                block_size=4, num_blocks=6, skip_mode="auto", max_model_len=64,
                kv_admission=kv_admission)
    args.update(kw)
    return Scheduler(scheduler_config(**args))


def run_one(s, tokens):
    """Schedule one plan and retire it, sampling from `tokens` (req_id -> next token)."""
    plan = s.schedule()
    events = s.retire(plan.mb_id, [(r.req_id, tokens(r)) for r in plan.rows if r.sample])
    return plan, events


def test_reserve_serializes_long_requests_on_demand_runs_them_together():
    for mode, first_plan in (("reserve", ["a"]), ("on-demand", ["a", "b"])):
        s = make(mode)
        for rid in "ab":  # 4-token prompts, 16 max_tokens: 5 blocks each to reserve
            s.add(SchedRequest(rid, (1, 2, 3, 4), 16))
        assert [r.req_id for r in s.schedule().rows] == first_plan


def test_youngest_is_preempted_and_resumes_with_its_tokens():
    s = make()
    sampling = SamplingSpec(repetition_penalty=1.2)  # needs history: the last stage gets it
    s.add(SchedRequest("a", (1, 2, 3, 4), 16))
    s.add(SchedRequest("b", (5, 6, 7, 8), 16, sampling))
    out = {"a": [], "b": []}
    plans = []
    while s.num_preemptions == 0:
        plan, events = run_one(s, lambda r: 100 + r.output_index)
        plans.append(plan)
        for e in events:
            assert e.output_index == len(out[e.req_id])
            out[e.req_id].append(e.token_id)
    # a needed a block: b, the youngest and not in that plan, was preempted (the same plan
    # tells the stages) and waits at the front of the queue; a went on.
    assert s.num_waiting == 1 and s.num_running == 1 and len(out["b"]) >= 1
    assert plan.finished == ("b",) and [r.req_id for r in plan.rows] == ["a"]
    while "b" not in {n.req_id for n in plan.new_requests}:
        plan, events = run_one(s, lambda r: 100 + r.output_index)
        if any(e.req_id == "a" and e.output_index == 15 for e in events):
            s.finish("a", "length")
    (new,) = plan.new_requests
    gen = tuple(out["b"])
    assert new.prompt_token_ids == (5, 6, 7, 8) and new.output_token_ids == gen
    row = plan.rows[0]
    # its prompt's block stayed cached after the preemption: it resumes after it
    start, end = row.start, row.start + row.num_tokens
    assert start == 4 and row.token_ids == ((5, 6, 7, 8) + gen)[start:end]
    assert s.pool.num_free == s.config.num_blocks - s.config.blocks_for(end)
    while s.has_work():
        plan, events = run_one(s, lambda r: 100 + r.output_index)
        for e in events:
            assert e.output_index == len(out[e.req_id])  # indices continue where they stopped
            out[e.req_id].append(e.token_id)
            if e.output_index == 15:
                s.finish(e.req_id, "length")
    assert out["b"] == [100 + i for i in range(16)]
    assert s.pool.num_free == 6 and s.num_preemptions >= 1


def test_prompt_too_large_for_the_pool_is_refused():
    s = make()
    with pytest.raises(ValueError):
        s.add(SchedRequest("a", tuple(range(30)), 1))  # 8 blocks > 6


@pytest.mark.parametrize("run_ahead", [False, True])
def test_driver_preempts_and_keeps_every_invariant(run_ahead):
    cfg = scheduler_config(chunk_size=4, max_num_batched_tokens=12, max_num_seqs=6,
                          max_inflight=3, block_size=2, num_blocks=12, skip_mode="auto",
                          max_model_len=64, run_ahead=run_ahead, num_stages=2,
                          kv_admission="on-demand")
    rng = random.Random(3)
    load = [(rng.randrange(10), rng.randrange(3, 12), rng.randrange(4, 12), False)
            for _ in range(10)]
    d = drive(cfg, load, seed=5, p_stop=0.0, p_abort=0.0)
    assert d.s.num_preemptions > 0 and d.n_missed == 0
