"""A pure simulated coordinator drives the scheduler through random loads and checks, from the
plans alone, everything the stages and the output channel rely on (DESIGN §3, §5, §6)."""

import random
from collections import defaultdict

import pytest
from hypothesis import given, settings, strategies as st

from app.scheduler import SchedRequest, Scheduler, SchedulerConfig, SchedulerInvariantError
from stages.protocol import SamplingSpec


def ceil_div(a, b):
    return -(-a // b)


class Driver:
    """Plays the coordinator and the stages; keeps its own books and checks every plan."""

    def __init__(self, cfg, rng, p_stop=0.1, p_abort=0.02):
        self.cfg, self.rng, self.p_stop, self.p_abort = cfg, rng, p_stop, p_abort
        self.s = Scheduler(cfg)
        self.reqs = {}  # req_id -> SchedRequest (accepted by add)
        self.admitted = set()
        self.finished = {}  # req_id -> reason
        self.prefill_pos = defaultdict(int)
        self.generated = defaultdict(int)
        self.last_mb = {}  # req_id -> mb that sampled its latest retired token
        self.planned = defaultdict(int)  # sampling rows dispatched (retired or in flight)
        self.sample_mb = {}  # req_id -> mb of its latest dispatched sampling row
        self.n_ahead = 0  # decode rows planned while the previous step was in flight
        self.tables = defaultdict(list)
        self.inflight = []  # plans in dispatch order
        self.req_inflight = defaultdict(int)
        self.slots = {}  # live slot -> req_id
        self.unannounced = set()
        self.plans = {}
        self.length_due = set()  # hit max_tokens, finish("length") not yet called
        self.orphan_watch = {}  # mb_id -> [pending req_ids, consumed?]
        self.n_sent = self.n_skipped = self.n_missed = self.n_orphaned = 0

    # -- the books --------------------------------------------------------------------------
    def holds_blocks(self, rid):
        return rid not in self.finished or self.req_inflight[rid] > 0

    def needed(self, row):
        return row.sample and row.output_index + 1 < self.reqs[row.req_id].max_tokens

    def add(self, rid, prompt_len, max_tokens, logprobs):
        req = SchedRequest(rid, tuple(self.rng.randrange(1000) for _ in range(prompt_len)),
                           max_tokens, SamplingSpec(), logprobs)
        fits = (prompt_len + max_tokens <= self.cfg.max_model_len and
                ceil_div(prompt_len + max_tokens, self.cfg.block_size) <= self.cfg.num_blocks)
        if not fits:
            with pytest.raises(ValueError):
                self.s.add(req)
            return
        self.s.add(req)
        self.reqs[rid] = req

    def finish(self, rid, reason):
        known = rid in self.reqs and rid not in self.finished
        assert self.s.finish(rid, reason) is known
        if not known:
            return
        self.finished[rid] = reason
        self.length_due.discard(rid)
        if rid in self.admitted:
            self.unannounced.add(rid)
        for mb, watch in list(self.orphan_watch.items()):
            if rid in watch[0]:
                watch[0].discard(rid)
                if not watch[0]:
                    del self.orphan_watch[mb]
                    self.n_orphaned += not watch[1]
        if self.req_inflight[rid] == 0:
            self.slots = {k: v for k, v in self.slots.items() if v != rid}

    # -- checking one plan ------------------------------------------------------------------
    def check_plan(self, plan):
        cfg = self.cfg
        assert len(self.inflight) < cfg.max_inflight
        assert plan.rows and plan.num_tokens <= cfg.max_num_batched_tokens
        ids = [r.req_id for r in plan.rows]
        assert len(ids) == len(set(ids))
        kinds = [r.is_prefill for r in plan.rows]
        assert kinds == sorted(kinds), "decode rows come first"
        assert set(plan.finished) == self.unannounced and len(plan.finished) == len(
            self.unannounced)
        self.unannounced.clear()
        for n in plan.new_requests:
            assert n.req_id not in self.admitted and n.req_id in ids
            assert n.slot not in self.slots and 0 <= n.slot < cfg.max_num_seqs
            self.admitted.add(n.req_id)
            self.slots[n.slot] = n.req_id
        for rid, new_ids in plan.block_updates:
            assert rid in ids and new_ids
            for b in new_ids:
                for other, table in self.tables.items():
                    assert not (b in table and self.holds_blocks(other)), \
                        f"block {b} of live {other} handed to {rid}"
            self.tables[rid].extend(new_ids)
        for row in plan.rows:
            rid, req = row.req_id, self.reqs[row.req_id]
            assert rid in self.admitted and rid not in self.finished
            assert self.slots.get(row.slot) == rid
            assert len(self.tables[rid]) >= ceil_div(row.start + row.num_tokens, cfg.block_size)
            assert len(self.tables[rid]) <= ceil_div(req.prompt_len + req.max_tokens,
                                                     cfg.block_size)
            if row.is_prefill:
                assert row.start == self.prefill_pos[rid], "prompt tokens in order, once"
                assert 1 <= row.num_tokens <= cfg.chunk_size
                assert row.token_ids == req.prompt_token_ids[row.start:row.start + row.num_tokens]
                self.prefill_pos[rid] += row.num_tokens
                assert row.sample == (self.prefill_pos[rid] == req.prompt_len)
                assert row.output_index == 0 and row.input_from_mb is None
            else:
                gen, planned = self.generated[rid], self.planned[rid]
                assert rid not in self.length_due and 1 <= planned < req.max_tokens
                assert self.prefill_pos[rid] == req.prompt_len
                if not cfg.run_ahead:
                    assert self.req_inflight[rid] == 0 and planned == gen
                    assert self.sample_mb[rid] == self.last_mb[rid]
                elif planned > gen:  # previous step in flight: at least S mbs back
                    assert plan.mb_id - self.sample_mb[rid] >= cfg.num_stages
                    self.n_ahead += 1
                assert row.token_ids is None and row.num_tokens == 1 and row.sample
                assert row.start == req.prompt_len + planned - 1 and row.output_index == planned
                src = self.plans[row.input_from_mb]
                assert row.input_from_mb == self.sample_mb[rid]
                assert src.send_output, "a decode row reads a skipped output"
                assert any(r.req_id == rid and r.sample and r.output_index == planned - 1
                           for r in src.rows), "input is not the request's previous token"
                watch = self.orphan_watch[row.input_from_mb]
                watch[0].discard(rid)
                watch[1] = True
                if not watch[0]:
                    del self.orphan_watch[row.input_from_mb]
            self.req_inflight[rid] += 1
            if row.sample:
                self.planned[rid] += 1
                self.sample_mb[rid] = plan.mb_id
        self.check_skip(plan)
        self.plans[plan.mb_id] = plan
        self.inflight.append(plan)

    def check_skip(self, plan):
        needed = [r.req_id for r in plan.rows if self.needed(r)]
        mode = self.cfg.skip_mode
        if mode == "off":
            assert plan.send_output
        elif mode == "auto":
            assert plan.send_output == bool(needed)
        else:  # the PR's rule, recomputed independently
            rows = plan.rows
            only = rows[0]
            skip = (len(rows) == 1 and only.is_prefill
                    and only.start + only.num_tokens < self.reqs[only.req_id].prompt_len
                    and not self.reqs[only.req_id].wants_logprobs)
            assert plan.send_output == (not skip)
        self.n_sent += plan.send_output
        self.n_skipped += not plan.send_output
        self.n_missed += plan.send_output and not needed
        if needed:
            self.orphan_watch[plan.mb_id] = [set(needed), False]

    # -- one step of the coordinator --------------------------------------------------------
    def retire_oldest(self):
        plan = self.inflight.pop(0)
        sampled = [(r.req_id, self.rng.randrange(1000)) for r in plan.rows
                   if r.sample and (r.req_id not in self.finished or self.rng.random() < 0.5)]
        events = self.s.retire(plan.mb_id, sampled)
        expect = [(r.req_id, r.output_index) for r in plan.rows
                  if r.sample and r.req_id not in self.finished]
        assert [(e.req_id, e.output_index) for e in events] == expect
        for row in plan.rows:
            self.req_inflight[row.req_id] -= 1
            if row.req_id in self.finished and self.req_inflight[row.req_id] == 0:
                self.slots = {k: v for k, v in self.slots.items() if v != row.req_id}
        for e in events:
            assert e.output_index == self.generated[e.req_id]
            self.generated[e.req_id] += 1
            self.last_mb[e.req_id] = plan.mb_id
            if self.generated[e.req_id] == self.reqs[e.req_id].max_tokens:
                self.length_due.add(e.req_id)
            elif self.rng.random() < self.p_stop:
                self.finish(e.req_id, "stop")

    def step(self):
        s, rng = self.s, self.rng
        if self.length_due and rng.random() < 0.5:
            self.finish(rng.choice(sorted(self.length_due)), "length")
        if rng.random() < self.p_abort:
            live = sorted(r for r in self.reqs if r not in self.finished)
            busy = [r for r in live if self.req_inflight[r] > 0]
            if busy and rng.random() < 0.7:  # aborts in flight stress the block refs
                live = busy
            if live:
                self.finish(rng.choice(live), "abort")
        if self.inflight and (rng.random() < 0.5 or len(self.inflight) >= self.cfg.max_inflight):
            self.retire_oldest()
            return
        plan = s.schedule()
        if plan is None:
            if self.inflight:
                self.retire_oldest()
            elif self.length_due:
                self.finish(sorted(self.length_due)[0], "length")
            else:
                assert not s.has_work(), "nothing in flight, work left, and no plan: deadlock"
            return
        self.check_plan(plan)
        assert s.inflight == len(self.inflight) <= self.cfg.max_inflight
        assert s.num_running == len(self.admitted - set(self.finished))
        assert 0.0 <= s.kv_usage <= 1.0

    def final_checks(self):
        s = self.s
        assert not s.has_work() and s.inflight == 0 and s.num_running == 0
        assert s.pool.num_free == self.cfg.num_blocks and s.pool.num_reserved == 0
        assert s.kv_usage == 0.0
        assert s.comm_stats() == {"sent": self.n_sent, "skipped": self.n_skipped,
                                  "missed": self.n_missed, "orphaned": self.n_orphaned}
        if self.cfg.skip_mode == "auto":
            assert self.n_missed == 0
        if self.cfg.skip_mode == "off":
            assert self.n_skipped == 0
        for rid, req in self.reqs.items():
            assert rid in self.finished
            if self.finished[rid] == "length":
                assert self.prefill_pos[rid] == req.prompt_len
                assert self.generated[rid] == req.max_tokens


configs = st.builds(
    SchedulerConfig,
    chunk_size=st.integers(1, 16), max_num_batched_tokens=st.integers(1, 40),
    max_num_seqs=st.integers(1, 6), max_inflight=st.integers(1, 4),
    block_size=st.integers(1, 8), num_blocks=st.integers(1, 40),
    skip_mode=st.sampled_from(["off", "sglang", "auto"]), max_model_len=st.integers(8, 80))
loads = st.lists(st.tuples(st.integers(0, 30), st.integers(1, 50), st.integers(1, 10),
                           st.booleans()), min_size=1, max_size=12)


run_ahead_configs = st.builds(
    SchedulerConfig,
    chunk_size=st.integers(1, 16), max_num_batched_tokens=st.integers(1, 40),
    max_num_seqs=st.integers(1, 6), max_inflight=st.integers(1, 9),
    block_size=st.integers(1, 8), num_blocks=st.integers(1, 40),
    skip_mode=st.sampled_from(["off", "sglang", "auto"]), max_model_len=st.integers(8, 80),
    run_ahead=st.just(True), num_stages=st.integers(1, 4))
drives = dict(load=loads, seed=st.integers(0, 2**32 - 1),
              p_stop=st.sampled_from([0.0, 0.05, 0.3]),
              p_abort=st.sampled_from([0.0, 0.03, 0.15]))


@settings(max_examples=300, deadline=None)
@given(cfg=configs, **drives)
def test_random_loads_keep_every_invariant(cfg, load, seed, p_stop, p_abort):
    drive(cfg, load, seed, p_stop, p_abort)


@settings(max_examples=300, deadline=None)
@given(cfg=run_ahead_configs, **drives)
def test_random_loads_with_run_ahead_keep_every_invariant(cfg, load, seed, p_stop, p_abort):
    drive(cfg, load, seed, p_stop, p_abort)


def drive(cfg, load, seed, p_stop, p_abort):
    d = Driver(cfg, random.Random(seed), p_stop, p_abort)
    arrivals = sorted((t, i, pl, mt, lp) for i, (t, pl, mt, lp) in enumerate(load))
    t = 0
    while arrivals or d.s.has_work():
        while arrivals and arrivals[0][0] <= t:
            _, i, pl, mt, lp = arrivals.pop(0)
            d.add(f"r{i}", pl, mt, lp)
        d.step()
        t += 1
        assert t < 20000, "no progress"
    d.final_checks()


def test_decode_from_skipped_output_is_caught():
    s = Scheduler(SchedulerConfig(chunk_size=4, max_num_batched_tokens=8, max_num_seqs=2,
                                  max_inflight=2, block_size=4, num_blocks=8, max_model_len=64))
    s.add(SchedRequest("a", (1, 2, 3), 3))
    plan = s.schedule()
    s.retire(plan.mb_id, [("a", 9)])
    s._ledger._outputs[plan.mb_id].sent = False  # corrupt the books: pretend it was skipped
    with pytest.raises(SchedulerInvariantError):
        s.schedule()
