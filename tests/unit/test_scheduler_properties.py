"""A pure simulated coordinator drives the scheduler through random loads and checks, from the
plans alone, everything the stages and the output channel rely on
(docs/ARCHITECTURE.md#the-flow-of-one-request).

With kv_admission="on-demand" the scheduler may preempt: a request listed in a plan's
`finished` that the driver did not finish was preempted; it is re-admitted later (a new
NewRequest) and prefills its prompt + the tokens it generated, each admission in order."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.scheduler import (
    ChunkCost,
    SchedRequest,
    Scheduler,
    SchedulerInvariantError,
)
from app.scheduler.config import SKIP_MODES
from tests.unit.scheduler_configs import scheduler_config
from tests.unit.scheduler_driver import drive

# None = fixed chunks; else dynamic chunking (chunks shrink as the prefix grows)
chunk_costs = st.one_of(st.none(), st.builds(ChunkCost, st.floats(0.1, 100.0),
                                             st.floats(0.01, 10.0)))
smooths = st.floats(0.0, 1.0)

common = dict(chunk_size=st.integers(1, 16), max_num_batched_tokens=st.integers(1, 40),
              max_num_seqs=st.integers(1, 6), skip_mode=st.sampled_from(SKIP_MODES),
              max_model_len=st.integers(8, 80), chunk_cost=chunk_costs,
              dynamic_chunk_smooth=smooths, enable_prefix_caching=st.booleans())
configs = st.builds(scheduler_config, **common, max_inflight=st.integers(1, 4),
                    block_size=st.integers(1, 8), num_blocks=st.integers(1, 40))
loads = st.lists(st.tuples(st.integers(0, 30), st.integers(1, 50), st.integers(1, 10),
                           st.booleans()), min_size=1, max_size=12)


run_ahead_configs = st.builds(
    scheduler_config, **common, max_inflight=st.integers(1, 9), block_size=st.integers(1, 8),
    num_blocks=st.integers(1, 40), run_ahead=st.just(True), num_stages=st.integers(1, 4))
on_demand_configs = st.builds(
    scheduler_config, **common, max_inflight=st.integers(1, 6), block_size=st.integers(1, 4),
    num_blocks=st.integers(2, 24), run_ahead=st.booleans(), num_stages=st.integers(1, 3),
    kv_admission=st.just("on-demand"))
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


@settings(max_examples=400, deadline=None)
@given(cfg=on_demand_configs, **drives)
def test_random_loads_with_on_demand_admission_keep_every_invariant(cfg, load, seed, p_stop,
                                                                     p_abort):
    drive(cfg, load, seed, p_stop, p_abort)


def test_decode_from_skipped_output_is_caught():
    s = Scheduler(scheduler_config(chunk_size=4, max_num_batched_tokens=8, max_num_seqs=2,
                                  max_inflight=2, block_size=4, num_blocks=8, max_model_len=64))
    s.add(SchedRequest("a", (1, 2, 3), 3))
    plan = s.schedule()
    s.retire(plan.mb_id, [("a", 9)])
    s._ledger._outputs[plan.mb_id].sent = False  # corrupt the books: pretend it was skipped
    with pytest.raises(SchedulerInvariantError):
        s.schedule()
