"""The simulated coordinator of the scheduler property tests (test_scheduler_properties.py):
plays the coordinator and the stages, keeps its own books, checks every plan."""

import random
from collections import defaultdict

import pytest

from app.scheduler import SchedRequest, Scheduler
from stages.protocol import SamplingSpec


def ceil_div(a, b):
    return -(-a // b)


class Driver:
    """Plays the coordinator and the stages; keeps its own books and checks every plan."""

    def __init__(self, cfg, rng, p_stop=0.1, p_abort=0.02):
        self.cfg, self.rng, self.p_stop, self.p_abort = cfg, rng, p_stop, p_abort
        self.events = defaultdict(int)  # what the scheduler reported, event by event
        self.s = Scheduler(cfg, on_output_event=self._on_output_event,
                           on_prefix_lookup=self._on_prefix_lookup)
        # prompts start with a piece of one of a few shared heads, so prefixes hit the cache
        self.heads = [tuple(rng.randrange(1000) for _ in range(60)) for _ in range(3)]
        self.written = {}  # block -> the tokens from position 0 through it its KV was computed on
        self.lookups = [0, 0]  # prefix cache queries, hits (tokens), as the driver saw them
        self.reported = [0, 0]
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
        self.outputs = defaultdict(list)  # req_id -> accepted tokens
        self.prefix = {}  # req_id -> what its current admission prefills
        self.preempted = set()  # preempted, not yet re-admitted
        self.n_preempted = 0

    # -- the books --------------------------------------------------------------------------
    def holds_blocks(self, rid):
        live = rid not in self.finished and rid not in self.preempted
        return live or self.req_inflight[rid] > 0

    def dead(self, rid):  # rows of rid in flight belong to an incarnation that ended
        return rid in self.finished or rid in self.preempted

    def needed(self, row):
        return row.sample and row.output_index + 1 < self.reqs[row.req_id].max_tokens

    def add(self, rid, prompt_len, max_tokens, logprobs):
        head = self.rng.choice(self.heads)[: self.rng.randrange(prompt_len + 1)]
        tail = tuple(self.rng.randrange(1000) for _ in range(prompt_len - len(head)))
        priority = self.rng.choice((0, 0, 0, -1, 2))  # mostly equal; some overtake, some wait
        req = SchedRequest(rid, head + tail, max_tokens, SamplingSpec(), logprobs,
                           priority=priority)
        fits = (prompt_len + max_tokens <= self.cfg.max_model_len and
                ceil_div(prompt_len + max_tokens, self.cfg.block_size) <= self.cfg.num_blocks)
        if not fits:
            with pytest.raises(ValueError):
                self.s.add(req)
            return
        self.s.add(req)
        self.reqs[rid] = req
        self.prefix[rid] = req.prompt_token_ids

    def finish(self, rid, reason):
        known = rid in self.reqs and rid not in self.finished
        assert self.s.finish(rid, reason) is known
        if not known:
            return
        self.finished[rid] = reason
        self.length_due.discard(rid)
        if rid in self.admitted and rid not in self.preempted:
            self.unannounced.add(rid)
        self.preempted.discard(rid)
        self.vanish(rid)
        if self.req_inflight[rid] == 0:
            self.slots = {k: v for k, v in self.slots.items() if v != rid}

    def preempt(self, rid):
        """The scheduler preempted live `rid`: back to the queue, prefix = prompt + outputs."""
        assert rid in self.admitted and not self.dead(rid) and rid not in self.length_due
        assert self.generated[rid] < self.reqs[rid].max_tokens
        assert self.cfg.kv_admission == "on-demand", "reserve mode never preempts"
        self.n_preempted += 1
        self.preempted.add(rid)
        self.admitted.discard(rid)
        self.prefill_pos[rid] = 0
        self.planned[rid] = self.generated[rid]
        self.prefix[rid] = self.reqs[rid].prompt_token_ids + tuple(self.outputs[rid])
        self.vanish(rid)
        if self.req_inflight[rid] == 0:
            self.slots = {k: v for k, v in self.slots.items() if v != rid}

    def see_preemptions(self, pending_finished):
        for rid in pending_finished:  # listed for the stages, not finished by us: preempted
            if rid not in self.unannounced:
                self.preempt(rid)
                self.unannounced.add(rid)

    def vanish(self, rid):
        for mb, watch in list(self.orphan_watch.items()):
            if rid in watch[0]:
                watch[0].discard(rid)
                if not watch[0]:
                    del self.orphan_watch[mb]
                    self.n_orphaned += not watch[1]

    # -- checking one plan ------------------------------------------------------------------
    def check_plan(self, plan):
        cfg = self.cfg
        assert len(self.inflight) < cfg.max_inflight
        assert plan.rows and plan.num_tokens <= cfg.max_num_batched_tokens
        ids = [r.req_id for r in plan.rows]
        assert len(ids) == len(set(ids))
        kinds = [r.is_prefill for r in plan.rows]
        assert kinds == sorted(kinds), "decode rows come first"
        self.see_preemptions(plan.finished)
        assert set(plan.finished) == self.unannounced
        assert len(plan.finished) == len(set(plan.finished))
        self.unannounced.clear()
        first_row = {r.req_id: r for r in plan.rows}
        for n in plan.new_requests:
            assert n.req_id not in self.admitted and n.req_id in ids
            cached = first_row[n.req_id].start  # a cached prefix: prefill starts after it
            assert first_row[n.req_id].is_prefill and cached % cfg.block_size == 0
            assert 0 <= cached < len(self.prefix[n.req_id]), "the last token is computed"
            assert cfg.enable_prefix_caching or cached == 0
            self.prefill_pos[n.req_id] = cached
            self.lookups[0] += len(self.prefix[n.req_id]) if cfg.enable_prefix_caching else 0
            self.lookups[1] += cached
            assert n.slot not in self.slots and 0 <= n.slot < cfg.max_num_seqs
            assert self.req_inflight[n.req_id] == 0, "re-admitted while its old self runs"
            assert n.output_token_ids in ((), tuple(self.outputs[n.req_id]))
            self.admitted.add(n.req_id)
            self.preempted.discard(n.req_id)
            self.tables[n.req_id] = []
            self.slots[n.slot] = n.req_id
        for rid, new_ids in plan.block_updates:
            assert rid in ids and new_ids
            table = self.tables[rid]
            for b in new_ids:
                i = len(table)
                if i < first_row[rid].start // cfg.block_size:  # a cache hit: shared, written
                    assert self.written.get(b) == self.prefix[rid][: (i + 1) * cfg.block_size], \
                        f"hit block {b} of {rid} does not hold its prefix"
                else:
                    for other, t in self.tables.items():
                        assert not (b in t and self.holds_blocks(other)), \
                            f"block {b} of live {other} handed to {rid}"
                    self.written.pop(b, None)
                table.append(b)
        for row in plan.rows:
            rid, req = row.req_id, self.reqs[row.req_id]
            assert rid in self.admitted and rid not in self.finished
            assert self.slots.get(row.slot) == rid
            assert len(self.tables[rid]) >= ceil_div(row.start + row.num_tokens, cfg.block_size)
            assert len(self.tables[rid]) <= ceil_div(req.prompt_len + req.max_tokens,
                                                     cfg.block_size)
            if row.is_prefill:  # the prefix: in order, once per admission
                prefix = self.prefix[rid]
                assert row.start == self.prefill_pos[rid], "prompt tokens in order, once"
                assert 1 <= row.num_tokens <= cfg.chunk_limit(row.start)
                assert row.token_ids == prefix[row.start:row.start + row.num_tokens]
                self.prefill_pos[rid] += row.num_tokens
                assert row.sample == (self.prefill_pos[rid] == len(prefix))
                assert row.output_index == self.generated[rid] == self.planned[rid]
                assert row.input_from_mb is None
            else:
                gen, planned = self.generated[rid], self.planned[rid]
                assert rid not in self.length_due and 1 <= planned < req.max_tokens
                assert self.prefill_pos[rid] == len(self.prefix[rid])
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
                    and only.start + only.num_tokens < len(self.prefix[only.req_id])
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
                   if r.sample and (not self.dead(r.req_id) or self.rng.random() < 0.5)]
        bs = self.cfg.block_size
        for row in plan.rows:  # the KV this mb wrote, now on every stage
            rid, end = row.req_id, row.start + row.num_tokens
            tokens = self.reqs[rid].prompt_token_ids + tuple(self.outputs[rid])
            for i in range(row.start // bs, min(end, len(tokens)) // bs):
                self.written[self.tables[rid][i]] = tokens[: (i + 1) * bs]
        events = self.s.retire(plan.mb_id, sampled)
        expect = [(r.req_id, r.output_index) for r in plan.rows
                  if r.sample and not self.dead(r.req_id)]
        assert [(e.req_id, e.output_index) for e in events] == expect
        for row in plan.rows:
            self.req_inflight[row.req_id] -= 1
            if self.dead(row.req_id) and self.req_inflight[row.req_id] == 0:
                self.slots = {k: v for k, v in self.slots.items() if v != row.req_id}
        for e in events:
            assert e.output_index == self.generated[e.req_id]
            self.generated[e.req_id] += 1
            self.outputs[e.req_id].append(e.token_id)
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
        if plan is None:  # preempting may still have happened: the next plan announces it
            self.see_preemptions(s.pending_finished())
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

    def _on_prefix_lookup(self, queried, hit):
        self.reported[0] += queried
        self.reported[1] += hit

    def _on_output_event(self, event, counts):
        self.events[event] += 1
        assert counts[event] == self.events[event]  # the counts after the event

    def final_checks(self):
        s = self.s
        assert {k: self.events[k] for k in s.comm_stats()} == s.comm_stats()
        assert not s.has_work() and s.inflight == 0 and s.num_running == 0
        assert s.pool.num_free == self.cfg.num_blocks and s.pool.num_reserved == 0
        assert s.kv_usage == 0.0
        assert self.lookups == self.reported == [s.prefix_stats.queries, s.prefix_stats.hits]
        hashes = [s.pool.hash_of(b) for b in range(self.cfg.num_blocks)]
        named = [h for h in hashes if h is not None]
        assert len(named) == len(set(named)) == s.pool.num_cached
        assert s.num_preemptions == self.n_preempted and not self.preempted
        assert s.comm_stats() == {"sent": self.n_sent, "skipped": self.n_skipped,
                                  "missed": self.n_missed, "orphaned": self.n_orphaned}
        if self.cfg.skip_mode == "auto":
            assert self.n_missed == 0
        if self.cfg.skip_mode == "off":
            assert self.n_skipped == 0
        for rid, req in self.reqs.items():
            assert rid in self.finished
            if self.finished[rid] == "length":
                assert self.prefill_pos[rid] == len(self.prefix[rid])
                assert self.generated[rid] == req.max_tokens


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
    return d
