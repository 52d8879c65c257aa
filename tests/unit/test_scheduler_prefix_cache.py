"""The scheduler's prefix cache on hand-made cases (the random loads are in
test_scheduler_properties.py): when a block becomes reusable, where a hit starts prefill,
what a failed pipeline forgets."""

from app.scheduler import SchedRequest, Scheduler
from tests.unit.scheduler_configs import scheduler_config


def make(**kw):
    args = dict(chunk_size=4, max_num_batched_tokens=8, max_num_seqs=4, max_inflight=2,
                block_size=4, num_blocks=16, max_model_len=64)
    args.update(kw)
    return Scheduler(scheduler_config(**args))


def req(rid, tokens, max_tokens=2):
    return SchedRequest(rid, tuple(tokens), max_tokens)


def prefill(s, rid):
    """Plan and retire until `rid` has sampled its first token; returns the plans."""
    plans = []
    while True:
        plan = s.schedule()
        plans.append(plan)
        sampled = [(r.req_id, 7) for r in plan.rows if r.sample]
        s.retire(plan.mb_id, sampled)
        if any(r == rid for r, _ in sampled):
            return plans


def test_a_finished_prompt_is_reused_after_its_cached_blocks():
    s = make()
    s.add(req("a", range(10)))  # blocks 0-3, 4-7 full; 8-9 partial
    prefill(s, "a")
    s.finish("a", "stop")
    assert s.pool.num_cached == 2 and s.pool.num_used == 0
    s.add(req("b", list(range(8)) + [50, 51, 52]))
    (plan,) = prefill(s, "b")
    (row,) = plan.rows
    assert row.start == 8 and row.token_ids == (50, 51, 52)  # after the cached 8 tokens
    (update,) = plan.block_updates
    assert update[0] == "b" and len(update[1]) == 3  # 2 shared + 1 new, announced together
    assert s.prefix_stats.queries == 10 + 11 and s.prefix_stats.hits == 8


def test_the_last_prompt_token_is_always_computed():
    s = make()
    s.add(req("a", range(8)))
    prefill(s, "a")
    s.add(req("b", range(8)))  # same prompt, a still running: shares its first block only
    plans = prefill(s, "b")
    first = next(r for p in plans for r in p.rows if r.req_id == "b")
    assert first.start == 4 and first.num_tokens == 4 and first.sample


def test_a_block_in_flight_is_not_reusable_until_its_microbatch_retires():
    s = make(chunk_size=8, max_num_batched_tokens=8)
    s.add(req("a", range(9)))
    p0 = s.schedule()  # a's first 8 tokens: blocks 0 and 1 being written
    s.add(req("b", range(9)))
    p1 = s.schedule()  # a's last token, and b, which must not read a's unwritten blocks
    b_row = next(r for r in p1.rows if r.req_id == "b")
    assert b_row.start == 0
    s.retire(p0.mb_id, [])
    s.retire(p1.mb_id, [("a", 7)])
    s.add(req("c", range(9)))
    plans = prefill(s, "c")
    assert next(r for p in plans for r in p.rows if r.req_id == "c").start == 8
    assert s.pool.num_cached == 2, "b's copy of the same blocks is never named twice"


def test_a_failed_pipeline_forgets_the_cache():
    s = make()
    s.add(req("a", range(9)))
    prefill(s, "a")
    s.add(req("b", [1, 2]))
    s.schedule()
    assert s.pool.num_cached == 2
    s.abort_inflight()
    assert s.pool.num_cached == 0
    s.finish("a", "stop")
    assert s.pool.num_free == s.pool.num_blocks


def test_disabled_never_hits():
    s = make(enable_prefix_caching=False)
    for rid in "ab":
        s.add(req(rid, range(9)))
        prefill(s, rid)
        s.finish(rid, "stop")
    assert s.pool.num_cached == 0 and s.prefix_stats.queries == s.prefix_stats.hits == 0
