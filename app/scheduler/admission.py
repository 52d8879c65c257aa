"""Admission of the head of the queue, and on-demand KV with recompute preemption (DESIGN §6).

`kv_admission="reserve"` (default): a request is admitted once the pool can reserve every block
it can ever need (prompt + max_tokens); nothing is ever preempted (see scheduler.py).

`kv_admission="on-demand"`:
A waiting request is admitted (FCFS) once a slot is free and the pool holds its prefill's
blocks plus one (capped at what it can ever need). Blocks are then taken as rows reach new
positions. When a row needs blocks the pool does not have, the youngest running request not
already in the plan being built is preempted (vLLM's recompute policy), until the blocks it
will give back cover the shortfall; if that youngest is the requester itself, its row is
skipped this round. A preempted request is finished at the stages (listed in the next plan's
`finished`); its blocks return once every in-flight microbatch naming it retires (the pool's
ref-counts), and it goes back to the front of the queue. Re-admitted (only once its previous
incarnation has left the books), it prefills prompt + the tokens generated so far, and its
output indices continue from that count, so seeded sampling gives the same tokens.

Progress: `add` refuses a request whose prompt + max_tokens exceeds the pool, so the oldest
running request can always finish alone; blocks still held by in-flight microbatches of
finished requests count as coming back, so nothing is preempted for them.
"""

from __future__ import annotations

from stages.protocol import NewRequest

from .state import ReqState, SchedRequest


class OnDemandAdmission:
    """Mixin of Scheduler: admission (both modes) and the on-demand preemption path."""

    @property
    def on_demand(self) -> bool:
        return self.config.kv_admission == "on-demand"

    def _pending_release(self) -> int:
        """Used blocks no live request owns: in-flight microbatches of finished ones hold them."""
        return self.pool.num_used - sum(len(st.blocks) for st in self._running.values())

    def _room(self, st: ReqState, end: int, named: list[ReqState]) -> bool:
        """Whether the plan may take a row of `st` reaching position `end` (exclusive); takes
        its blocks out of the plan's budget, preempting the youngest if needed."""
        if not self.on_demand:
            return True  # its reservation covers it
        k = self.config.blocks_for(end) - len(st.blocks)
        if k <= 0:
            return True
        taken = {s.req_id for s in named}
        while k > self.pool.num_free - self._plan_need + self._pending_release():
            victim = next((v for v in reversed(self._running.values())
                           if v.req_id not in taken and v.generated < v.req.max_tokens), None)
            if victim is None:
                return False
            self._preempt(victim)
            if victim is st:
                return False
        if k > self.pool.num_free - self._plan_need:
            return False  # what is short comes back when in-flight microbatches retire
        self._plan_need += k
        return True

    def _preempt(self, st: ReqState) -> None:
        rid = st.req_id
        outputs = tuple(st.output_ids)
        self.finish(rid, "preempted")
        self.num_preemptions += 1
        self._resume[rid] = outputs
        self._waiting = {rid: st.req, **self._waiting}

    def _admit_head(self, budget: int,
                    named: list[ReqState]) -> tuple[ReqState, NewRequest] | None:
        """Admit the head of the queue, or None if it does not fit yet (FCFS: then nobody is)."""
        req = next(iter(self._waiting.values()))
        if self.on_demand:
            admitted = self._admit_on_demand(req)
            if admitted is not None:  # the first chunk fits in what admission checked
                st = admitted[0]
                self._room(st, min(self.config.chunk_limit(st.prefill_pos), st.prefill_left,
                                   budget), named)
            return admitted
        need = self.config.blocks_for(req.prompt_len + req.max_tokens)
        if not self.pool.can_reserve(need):
            return None
        del self._waiting[req.req_id]
        self.pool.reserve(req.req_id, need)
        st = ReqState(req, self._free_slots.popleft())
        self._running[req.req_id] = st
        self._states[req.req_id] = st
        return st, NewRequest(req.req_id, st.slot, req.sampling, self._prompt_for(req))

    @staticmethod
    def _prompt_for(req: SchedRequest) -> tuple[int, ...]:
        # The last stage needs the prompt only for the repetition penalty (protocol.NewRequest).
        return req.prompt_token_ids if req.sampling.repetition_penalty != 1.0 else ()

    def _admit_on_demand(self, req: SchedRequest) -> tuple[ReqState, NewRequest] | None:
        """Admit the head of the queue if the pool holds its prefill + one block."""
        cfg = self.config
        if req.req_id in self._states:
            return None  # its preempted incarnation is still in flight: FCFS, wait
        outputs = self._resume.get(req.req_id, ())
        prefix = req.prompt_token_ids + outputs
        need = min(cfg.blocks_for(len(prefix)) + 1, cfg.blocks_for(req.prompt_len + req.max_tokens))
        if need > self.pool.num_free - self._plan_need:
            return None
        del self._waiting[req.req_id]
        self._resume.pop(req.req_id, None)
        st = ReqState(req, self._free_slots.popleft(), prefix=prefix, output_ids=list(outputs),
                      generated=len(outputs), planned=len(outputs))
        self._running[req.req_id] = st
        self._states[req.req_id] = st
        history = outputs if req.sampling.needs_history else ()
        return st, NewRequest(req.req_id, st.slot, req.sampling, self._prompt_for(req), history)
