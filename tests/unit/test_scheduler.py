"""Example-based tests of the scheduler: the skip modes on typical loads, and the API edges."""

import pytest

from app.config import EngineConfig
from app.scheduler import SchedRequest, Scheduler
from stages.protocol import SamplingSpec
from tests.unit.scheduler_configs import scheduler_config


def make(mode="auto", **kw):
    args = dict(chunk_size=8, max_num_batched_tokens=8, max_num_seqs=4, max_inflight=2,
                block_size=4, num_blocks=64, skip_mode=mode, max_model_len=256)
    args.update(kw)
    return Scheduler(scheduler_config(**args))


def req(rid, n, max_tokens=3, **kw):
    return SchedRequest(rid, tuple(range(100, 100 + n)), max_tokens, **kw)


def run_to_end(s, stop_at=None):
    """A simple coordinator: keep max_inflight plans in flight, retire in order, finish at
    max_tokens. Returns the plans in dispatch order."""
    plans, inflight, generated = [], [], {}
    while s.has_work():
        plan = s.schedule()
        if plan is not None:
            plans.append(plan)
            inflight.append(plan)
            continue
        assert inflight, "stuck"
        done = inflight.pop(0)
        toks = [(r.req_id, 7) for r in done.rows if r.sample and s.is_known(r.req_id)]
        for e in s.retire(done.mb_id, toks):
            generated[e.req_id] = e.output_index + 1
            if stop_at and stop_at.get(e.req_id) == e.output_index:
                s.finish(e.req_id, "stop")
            elif generated[e.req_id] == s_max(s, e.req_id):
                s.finish(e.req_id, "length")
    return plans


def s_max(s, rid):
    return s._states[rid].req.max_tokens


def test_lone_long_prompt_auto_skips_every_chunk_but_the_last():
    s = make("auto")
    s.add(req("a", 80, max_tokens=3))  # 10 chunks of 8
    plans = run_to_end(s)
    prefill = [p for p in plans if p.rows[0].is_prefill]
    assert len(prefill) == 10
    assert [p.send_output for p in prefill] == [False] * 9 + [True]
    decodes = [p for p in plans if not p.rows[0].is_prefill]
    # output 1 is read by the next decode; output 2 is the last token: nobody reads it
    assert [p.send_output for p in decodes] == [True, False]
    assert s.comm_stats() == {"sent": 2, "skipped": 10, "missed": 0, "orphaned": 0}
    assert s.pool.num_free == 64 and s.kv_usage == 0.0


def test_lone_long_prompt_off_misses_and_sglang_matches_auto_on_chunks():
    s = make("off")
    s.add(req("a", 80, max_tokens=3))
    run_to_end(s)
    assert s.comm_stats() == {"sent": 12, "skipped": 0, "missed": 10, "orphaned": 0}
    g = make("sglang")
    g.add(req("a", 80, max_tokens=3))
    run_to_end(g)
    assert g.comm_stats() == {"sent": 3, "skipped": 9, "missed": 1, "orphaned": 0}


def test_concurrent_long_prompts_sglang_misses_auto_skips():
    stats = {}
    for mode in ("sglang", "auto"):
        s = make(mode, chunk_size=8, max_num_batched_tokens=24, max_inflight=3)
        for i in range(3):
            s.add(req(f"r{i}", 64, max_tokens=4))
        plans = run_to_end(s)
        assert any(len(p.rows) == 3 and all(r.is_prefill for r in p.rows) for p in plans)
        stats[mode] = s.comm_stats()
    assert stats["sglang"]["missed"] > 0
    assert stats["auto"]["missed"] == 0
    assert stats["auto"]["skipped"] > stats["sglang"]["skipped"]


def test_several_chunks_in_flight_and_first_decode_waits():
    s = make(chunk_size=4, max_num_batched_tokens=4, max_inflight=3)
    s.add(req("a", 8, max_tokens=2))
    p0, p1 = s.schedule(), s.schedule()
    assert (p0.rows[0].start, p1.rows[0].start) == (0, 4) and p1.rows[0].sample
    assert s.schedule() is None  # prompt all planned; decode waits for the last chunk
    assert s.retire(p0.mb_id, []) == []
    assert s.schedule() is None
    (ev,) = s.retire(p1.mb_id, [("a", 42)])
    assert tuple(ev) == ("a", 42, 0)
    d = s.schedule()
    (row,) = d.rows
    assert (row.start, row.input_from_mb, row.output_index, row.token_ids) == (8, 1, 1, None)
    assert not d.send_output  # max_tokens=2: the second token is the last one
    s.retire(d.mb_id, [("a", 5)])
    assert s.num_running == 1 and s.schedule() is None  # not auto-finished, no decode
    assert s.finish("a", "length")
    assert not s.has_work() and s.pool.num_free == 64


def test_plan_lists_new_requests_blocks_and_finished():
    s = make(max_num_batched_tokens=16, num_blocks=64)
    s.add(req("a", 6, max_tokens=2, sampling=SamplingSpec(repetition_penalty=1.1)))
    s.add(req("b", 6, max_tokens=2))
    p = s.schedule()
    assert [n.req_id for n in p.new_requests] == ["a", "b"]
    assert {n.slot for n in p.new_requests} == {0, 1}
    assert p.new_requests[0].prompt_token_ids == tuple(range(100, 106))
    assert p.new_requests[1].prompt_token_ids == ()
    assert dict(p.block_updates) == {"a": (0, 1), "b": (2, 3)}
    s.finish("b", "abort")  # still in flight: blocks and slot stay taken
    assert s.pool.refcount(2) == 1 and s.num_running == 1
    s.retire(p.mb_id, [("a", 1), ("b", 2)])  # b's token is dropped
    assert s.pool.refcount(2) == 0
    q = s.schedule()
    assert q.finished == ("b",) and [r.req_id for r in q.rows] == ["a"]
    assert q.block_updates == ()  # position 6 still fits in a's second block


def test_finish_while_in_flight_never_lends_blocks():
    s = make(chunk_size=4, max_num_batched_tokens=4, num_blocks=3, max_inflight=2,
             enable_prefix_caching=False)  # b's prompt is a's: it would share a's first block
    s.add(req("a", 8, max_tokens=4))  # needs all 3 blocks
    s.add(req("b", 8, max_tokens=4))
    p0 = s.schedule()
    s.finish("a", "abort")
    assert s.schedule() is None  # a's block is still named by p0: b must wait
    s.retire(p0.mb_id, [])
    p1 = s.schedule()
    assert p1.finished == ("a",) and p1.new_requests[0].req_id == "b"
    assert p1.block_updates == (("b", (0,)),)  # a's block, now that p0 has retired


def test_orphaned_counts_sends_whose_consumers_vanished():
    s = make("auto")
    s.add(req("a", 4, max_tokens=5))
    run_to_end(s, stop_at={"a": 1})
    assert s.comm_stats() == {"sent": 2, "skipped": 0, "missed": 0, "orphaned": 1}


def test_add_refuses_what_can_never_fit():
    s = make(max_model_len=32, num_blocks=4)
    with pytest.raises(ValueError, match="max_model_len"):
        s.add(req("a", 30, max_tokens=3))
    with pytest.raises(ValueError, match="KV blocks"):
        s.add(req("b", 15, max_tokens=3))  # 18 tokens = 5 blocks of 4 > 4
    with pytest.raises(ValueError, match="max_tokens"):
        s.add(req("c", 3, max_tokens=0))
    with pytest.raises(ValueError, match="empty"):
        s.add(req("d", 0))
    s.add(req("e", 3))
    with pytest.raises(ValueError, match="already known"):
        s.add(req("e", 3))
    assert s.num_waiting == 1 and s.finish("e", "abort") and s.num_waiting == 0
    assert not s.finish("e", "abort") and not s.finish("zzz", "abort")


def test_retire_checks_order_and_tokens():
    s = make(chunk_size=4, max_num_batched_tokens=4)
    s.add(req("a", 4))
    s.add(req("b", 4))
    p0, p1 = s.schedule(), s.schedule()
    with pytest.raises(ValueError, match="out of order"):
        s.retire(p1.mb_id, [("b", 1)])
    with pytest.raises(ValueError, match="no token"):
        s.retire(p0.mb_id, [])
    with pytest.raises(ValueError, match="sampled no token"):
        s.retire(p0.mb_id, [("b", 1)])
    assert s.inflight == 2  # failed retires changed nothing
    s.retire(p0.mb_id, [("a", 1)])
    s.retire(p1.mb_id, [("b", 1)])
    with pytest.raises(ValueError, match="no microbatch"):
        s.retire(5, [])


def test_max_num_seqs_and_budget_limit_admission():
    s = make(max_num_seqs=1, max_num_batched_tokens=100, chunk_size=100)
    s.add(req("a", 4, max_tokens=1))
    s.add(req("b", 4, max_tokens=1))
    p = s.schedule()
    assert [r.req_id for r in p.rows] == ["a"] and s.num_waiting == 1
    assert not p.send_output  # max_tokens=1: the only token is the last


@pytest.mark.parametrize("kw", [dict(chunk_size=0), dict(max_inflight=-1),
                                dict(pp_output_skip="sometimes"), dict(block_size=1.5)])
def test_config_validation(kw):
    """The scheduler's options are checked once, by EngineConfig, naming the option."""
    with pytest.raises(ValueError, match=next(iter(kw))):
        EngineConfig(**kw)


def test_abort_inflight_after_a_stage_failure():
    s = make(chunk_size=4, max_num_batched_tokens=8, max_inflight=2)
    s.add(req("a", 8))
    s.add(req("b", 4))
    s.add(req("c", 4))
    p0, _ = s.schedule(), s.schedule()
    with pytest.raises(ValueError, match="no token"):
        s.retire(p0.mb_id, [])  # live requests sampled here: finish them first
    assert s.abort_inflight() == ["a", "b", "c"]
    assert s.inflight == 0 and s.num_running == 0 and not s.has_work()
    assert s.pool.num_free == 64
    assert s.schedule() is None
    s.add(req("d", 4))
    assert s.schedule().finished == ("a", "b", "c")
