"""A constrained request (structured output) is never run ahead: its next step's token mask
needs the previous token, so the step waits until that token has retired."""

from app.scheduler import SchedRequest
from tests.unit.test_scheduler_run_ahead import make, rows


def test_constrained_request_waits_for_its_previous_token():
    s = make()
    s.add(SchedRequest("free", tuple(range(10, 18)), 4))
    s.add(SchedRequest("json", tuple(range(20, 28)), 4, constrained=True))
    plans = [s.schedule() for _ in range(4)]
    # the free request runs ahead (mb 2 reads mb 0 in flight); the constrained one does not
    assert [rows(p) for p in plans if p] == [
        [("free", 0, None)],
        [("json", 0, None)],
        [("free", 1, 0)],
    ]
    s.retire(0, [("free", 5)])
    s.retire(1, [("json", 6)])
    plan = s.schedule()  # json's first token is back: its step 1 may go (with free's step 2)
    assert ("json", 1, 1) in rows(plan)
    s.retire(2, [("free", 5)])
    later = s.schedule()
    assert later is None or all(r.req_id != "json" for r in later.rows)
