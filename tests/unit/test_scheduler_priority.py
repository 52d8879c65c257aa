"""Priority among the waiting requests (vLLM's `priority`: lower first, then arrival): the
queue's order, and the scheduler admitting in it."""

from app.scheduler import SchedRequest
from app.scheduler.waiting import WaitingQueue
from tests.unit.test_scheduler import make, req, run_to_end


def ids(queue):
    return [r.req_id for r in queue]


def test_queue_orders_by_priority_then_arrival_and_requeues_in_front_of_its_priority():
    q = WaitingQueue()
    for rid, prio in (("a", 0), ("b", 0), ("c", -1), ("d", 2), ("e", -1), ("f", 0)):
        q.add(SchedRequest(rid, (1,), 1, priority=prio))
    assert ids(q) == ["c", "e", "a", "b", "f", "d"]
    q.requeue(SchedRequest("p", (1,), 1, priority=0))  # preempted: first of priority 0
    q.requeue(SchedRequest("r", (1,), 1, priority=0))  # the later one ahead of it
    assert ids(q) == ["c", "e", "r", "p", "a", "b", "f", "d"]
    assert q.pop("e").req_id == "e" and q.pop("e") is None and "e" not in q
    assert q.head().req_id == "c" and len(q) == 7


def test_equal_priorities_keep_fcfs_with_preempted_first():
    q = WaitingQueue()
    for rid in "abc":
        q.add(SchedRequest(rid, (1,), 1))
    q.requeue(SchedRequest("x", (1,), 1))
    assert ids(q) == ["x", "a", "b", "c"]


def test_a_waiting_request_of_higher_priority_is_admitted_first():
    """One slot, five requests queued at once: the urgent one (queued fourth) is admitted
    first, the same-priority ones in arrival order, the low-priority one last."""
    s = make(max_num_seqs=1)
    s.add(req("long", 40, max_tokens=2))
    s.add(req("b", 8, max_tokens=2))
    s.add(req("c", 8, max_tokens=2))
    s.add(req("urgent", 8, max_tokens=2, priority=-5))
    s.add(req("later", 8, max_tokens=2, priority=3))
    plans = run_to_end(s)
    admitted = [n.req_id for p in plans for n in p.new_requests]
    assert admitted == ["urgent", "long", "b", "c", "later"]
