"""Run-ahead decoding (docs/ARCHITECTURE.md#run-ahead-decoding): step t+1 planned once step t is
dispatched, at least S microbatches later; stops while a step is in flight orphan its send and leak
nothing."""

from app.scheduler import SchedRequest, Scheduler
from tests.unit.scheduler_configs import scheduler_config


def make(run_ahead=True, **kw):
    args = dict(chunk_size=8, max_num_batched_tokens=8, max_num_seqs=4, max_inflight=4,
                block_size=4, num_blocks=64, skip_mode="auto", max_model_len=256,
                run_ahead=run_ahead, num_stages=2)
    args.update(kw)
    return Scheduler(scheduler_config(**args))


def two_requests(s, max_tokens):
    for rid in "ab":  # 8-token prompts, one microbatch each
        s.add(SchedRequest(rid, tuple(range(10, 18)), max_tokens))
    return [s.schedule() for _ in range(4)]


def rows(plan):
    return [(r.req_id, r.output_index, r.input_from_mb) for r in plan.rows]


def test_decode_steps_are_planned_while_the_previous_one_is_in_flight():
    s = make()
    plans = two_requests(s, max_tokens=3)
    assert [rows(p) for p in plans] == [[("a", 0, None)], [("b", 0, None)],
                                        [("a", 1, 0)], [("b", 1, 1)]]
    assert all(p.send_output for p in plans)  # every token above is read by a later step
    assert s.schedule() is None  # max_inflight
    s.retire(0, [("a", 5)])
    p4 = s.schedule()  # a's step 2 reads mb 2, still in flight, two mbs back
    assert rows(p4) == [("a", 2, 2)] and p4.rows[0].start == 8 + 2 - 1
    assert not p4.send_output  # a's last token (max_tokens 3): nobody reads it
    assert s.schedule() is None  # b's step 2 may not follow its step 1 (mb 3) right away
    s.retire(1, [("b", 5)])
    assert rows(s.schedule()) == [("b", 2, 3)]
    for mb in (2, 3, 4, 5):
        for e in s.retire(mb, [(r.req_id, 7) for r in s._inflight[0].plan.rows]):
            if e.output_index == 2:
                s.finish(e.req_id, "length")
    assert s.schedule() is None and not s.has_work()  # never more than max_tokens steps
    assert s.comm_stats() == {"sent": 4, "skipped": 2, "missed": 0, "orphaned": 0}
    assert s.pool.num_free == 64


def test_stop_with_a_step_in_flight_orphans_its_send_and_frees_blocks_after_retire():
    s = make()
    two_requests(s, max_tokens=5)
    s.retire(0, [("a", 5)])
    assert rows(s.schedule()) == [("a", 2, 2)]  # mb 4, needed: sent
    s.retire(1, [("b", 5)])
    s.retire(2, [("a", 6)])
    a_blocks = list(s._states["a"].blocks)
    assert s.finish("a", "stop")  # a stops at output 1; its step 2 (mb 4) is in flight
    assert s.comm_stats()["orphaned"] == 1
    assert all(s.pool.refcount(b) > 0 for b in a_blocks)  # mb 4 still names them
    plan = s.schedule()
    assert plan.finished == ("a",) and [r.req_id for r in plan.rows] == ["b"]
    s.retire(3, [("b", 6)])
    assert s.retire(4, [("a", 9)]) == []  # the token of a finished request is dropped
    assert all(s.pool.refcount(b) == 0 for b in a_blocks)
    s.retire(plan.mb_id, [("b", 7)])
    s.finish("b", "stop")
    while s.inflight:
        s.retire(s.inflight_mb_ids()[0], [])
    assert s.pool.num_free == 64 and s.pool.num_reserved == 0 and not s.has_work()


def test_without_run_ahead_a_step_waits_for_the_previous_token():
    s = make(run_ahead=False)
    plans = two_requests(s, max_tokens=3)
    assert [rows(p) for p in plans[:2]] == [[("a", 0, None)], [("b", 0, None)]]
    assert plans[2:] == [None, None]
    s.retire(0, [("a", 5)])
    assert rows(s.schedule()) == [("a", 1, 0)]


def test_tokens_from_the_host_wait_for_their_token_and_ride_in_the_plan():
    """--output-channel host: a decode row carries the retired token itself; run-ahead still
    fills the pipeline with other requests but never plans a step before its input is back."""
    s = make(tokens_from_host=True)
    plans = two_requests(s, max_tokens=3)
    assert [rows(p) for p in plans[:2]] == [[("a", 0, None)], [("b", 0, None)]]
    assert plans[2:] == [None, None]  # neither token is back yet
    s.retire(0, [("a", 41)])
    p2 = s.schedule()
    assert rows(p2) == [("a", 1, None)] and p2.rows[0].token_ids == (41,)
    assert p2.rows[0].start == 8 and not p2.rows[0].is_prefill
    assert s.schedule() is None  # a's next step needs p2's token; b's is not back
    s.retire(1, [("b", 42)])
    s.retire(2, [("a", 43)])
    p3 = s.schedule()
    assert [(r.req_id, r.token_ids) for r in p3.rows] == [("a", (43,)), ("b", (42,))]
    assert s.comm_stats()["missed"] == 0  # the skip decisions are the channel's as ever
