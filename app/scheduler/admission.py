"""KV admission strategies (docs/ARCHITECTURE.md#kv-cache): when the head of the queue may start,
and where a running request's next blocks come from. The scheduler holds one, chosen by
kv_admission.

`ReserveAdmission` ("reserve", default): a request is admitted once the pool can reserve every
block it can ever need (prompt + max_tokens); nothing is ever preempted (see scheduler.py).

`OnDemandAdmission` ("on-demand"): a waiting request is admitted (FCFS) once a slot is free and
the pool holds its prefill's blocks plus one (capped at what it can ever need). Blocks are then
taken as rows reach new positions. When a row needs blocks the pool does not have, the youngest
running request not already in the plan being built is preempted (vLLM's recompute policy),
until the blocks it will give back cover the shortfall; if that youngest is the requester
itself, its row is skipped this round. A preempted request is finished at the stages (listed in
the next plan's `finished`); its blocks return once every in-flight microbatch naming it retires
(the pool's ref-counts), and it goes back to the front of the queue. Re-admitted (only once its
previous incarnation has left the books), it prefills prompt + the tokens generated so far, and
its output indices continue from that count, so seeded sampling gives the same tokens.

Progress: `add` refuses a request whose prompt + max_tokens exceeds the pool, so the oldest
running request can always finish alone; blocks still held by in-flight microbatches of
finished requests count as coming back, so nothing is preempted for them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .block_pool import BlockPool
from .config import SchedulerConfig
from .state import ReqState, SchedRequest


class ReserveAdmission:
    def __init__(self, config: SchedulerConfig, pool: BlockPool) -> None:
        self.config, self.pool = config, pool

    def begin_plan(self) -> None:
        """A new plan is being built."""

    def _revived(self, hits: Sequence[int]) -> int:
        """Cached blocks among `hits` that nobody references: taking them uses free blocks."""
        return sum(self.pool.refcount(b) == 0 for b in hits)

    def admit(self, req: SchedRequest, prefix_len: int, hits: Sequence[int] = ()) -> bool:
        """Whether the head of the queue starts now (and its blocks are set aside); `hits` are
        the cached blocks its prefix starts with, which it will share instead of allocating."""
        need = self.config.blocks_for(req.prompt_len + req.max_tokens) - len(hits)
        if not self.pool.can_reserve(need + self._revived(hits)):
            return False
        self.pool.reserve(req.req_id, need)
        return True

    def room(
        self,
        st: ReqState,
        end: int,
        named: Sequence[ReqState],
        running: dict[str, ReqState],
        preempt: Callable[[ReqState], None],
    ) -> bool:
        """Whether the plan may take a row of `st` reaching position `end`: its reservation
        covers it."""
        return True

    def take(self, req_id: str, n: int) -> tuple[int, ...]:
        return self.pool.allocate(req_id, n)


class OnDemandAdmission(ReserveAdmission):
    def __init__(self, config: SchedulerConfig, pool: BlockPool) -> None:
        super().__init__(config, pool)
        self._plan_need = 0  # blocks the plan being built will take

    def begin_plan(self) -> None:
        self._plan_need = 0

    def admit(self, req: SchedRequest, prefix_len: int, hits: Sequence[int] = ()) -> bool:
        cfg = self.config
        need = min(cfg.blocks_for(prefix_len) + 1, cfg.blocks_for(req.prompt_len + req.max_tokens))
        need += self._revived(hits) - len(hits)
        return need <= self.pool.num_free - self._plan_need

    def room(
        self,
        st: ReqState,
        end: int,
        named: Sequence[ReqState],
        running: dict[str, ReqState],
        preempt: Callable[[ReqState], None],
    ) -> bool:
        """Takes the row's blocks out of the plan's budget, preempting the youngest running
        request (through `preempt`) if needed."""
        k = self.config.blocks_for(end) - len(st.blocks)
        if k <= 0:
            return True
        if k <= self.pool.num_free - self._plan_need:  # fits: no need to look for victims
            self._plan_need += k
            return True
        taken = {s.req_id for s in named}
        while k > self.pool.num_free - self._plan_need + self._pending_release(running):
            victim = next(
                (
                    v
                    for v in reversed(running.values())
                    if v.req_id not in taken and v.generated < v.req.max_tokens
                ),
                None,
            )
            if victim is None:
                return False
            preempt(victim)
            if victim is st:
                return False
        if k > self.pool.num_free - self._plan_need:
            return False  # what is short comes back when in-flight microbatches retire
        self._plan_need += k
        return True

    def _pending_release(self, running: dict[str, ReqState]) -> int:
        """Used blocks no live request owns: in-flight microbatches of finished ones hold them."""
        owned = set().union(*(st.blocks for st in running.values()))  # prefix blocks are shared
        return self.pool.num_used - len(owned)

    def take(self, req_id: str, n: int) -> tuple[int, ...]:
        return self.pool.take(req_id, n)


ADMISSIONS = {"reserve": ReserveAdmission, "on-demand": OnDemandAdmission}
