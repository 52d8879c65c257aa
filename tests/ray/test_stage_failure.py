"""A stage that dies mid-prefill (a real `ray.kill`, no mocks) fails only the request in flight,
with a clear error; the coordinator rebuilds the pipeline (docs/ARCHITECTURE.md#when-a-stage-fails),
the requests that were only waiting complete normally, and the rebuilt pipeline gives the same
greedy tokens as before with the KV pool whole again."""

from __future__ import annotations

import random
import re
import time

import pytest

from app import Engine, EngineConfig, SamplingParams
from app.pipeline import STAGE_NAMESPACE

TIMEOUT = 60  # seconds: a hang fails the test instead of stalling the suite
LONG = 3000  # prompt tokens; chunks of 16 -> ~190 microbatches of prefill
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _prompt(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(0, 256) for _ in range(n)]


def _wait_for(engine, pred, what, timeout=TIMEOUT):
    deadline = time.time() + timeout
    while time.time() < deadline:
        stats = engine.stats()
        if pred(stats):
            return stats
        time.sleep(0.005)
    raise AssertionError(f"timed out waiting for {what}: {engine.stats()}")


def kill_stage_mid_prefill(ray, engine, stage, timeout=TIMEOUT):
    """One LONG request, and `stage` killed (ray.kill) while it prefills: its failed output."""
    pid = engine.stats()["pipeline_id"]
    victim = engine._actor.generate_batch.remote([_prompt(LONG, 0)], [GREEDY])
    _wait_for(engine, lambda s: s["num_running"] == 1, "the long request to start")
    name = f"ppserve-{pid}-stage{stage}"
    ray.kill(ray.get_actor(name, namespace=STAGE_NAMESPACE), no_restart=True)
    [failed] = ray.get(victim, timeout=timeout)
    return failed


@pytest.mark.parametrize("pp,victim", [(3, 1), (2, 1), (3, 0)],
                         ids=["pp3-middle", "pp2-last", "pp3-first"])
def test_stage_killed_mid_prefill(ray_cluster, pp, victim):
    ray = ray_cluster
    cfg = EngineConfig(pp_size=pp, device="cpu", chunk_size=16, block_size=16, max_num_seqs=1,
                       stage_num_cpus=0.5, num_kv_blocks=256, channel_check=True)
    short = [_prompt(20, seed) for seed in (1, 2)]
    with Engine(cfg) as engine:
        before = [o.token_ids for o in engine.generate(short, GREEDY)]
        pid = engine.stats()["pipeline_id"]
        names = [f"ppserve-{pid}-stage{i}" for i in range(pp)]
        for name in names:  # operators (and this test) find the stages by name
            ray.get_actor(name, namespace=STAGE_NAMESPACE)

        victim_ref = engine._actor.generate_batch.remote([_prompt(LONG, 0)], [GREEDY])
        _wait_for(engine, lambda s: s["num_running"] == 1, "the long request to start")
        # Queued behind the full max_num_seqs=1: these must survive the failure.
        waiting_ref = engine._actor.generate_batch.remote(short, [GREEDY] * 2)
        _wait_for(engine, lambda s: s["num_waiting"] == 2, "two requests waiting")
        ready, _ = ray.wait([victim_ref], timeout=0)
        assert not ready, "the long request finished before the kill: make LONG larger"

        ray.kill(ray.get_actor(names[victim], namespace=STAGE_NAMESPACE), no_restart=True)

        [failed] = ray.get(victim_ref, timeout=TIMEOUT)
        assert failed.finished and failed.finish_reason == "error"
        assert "pipeline failed" in failed.error and "restarted" in failed.error, failed.error
        # It names a stage, not Ray's internals (those are in the coordinator's log).
        assert re.search(rf"\(stage \d of {pp} stopped\)", failed.error), failed.error
        for internal in ("actor", "pid", "Traceback", "ip:", "node", names[victim]):
            assert internal not in failed.error, failed.error
        assert failed.token_ids == []  # it died in prefill

        waited = ray.get(waiting_ref, timeout=TIMEOUT)
        assert [o.finish_reason for o in waited] == ["length", "length"]
        assert [o.error for o in waited] == [None, None]
        assert [o.token_ids for o in waited] == before

        after = engine.generate(short, GREEDY)
        assert [o.token_ids for o in after] == before
        assert [o.finish_reason for o in after] == ["length", "length"]

        stats = engine.stats()
        assert stats["pipeline_failures"] == 1
        assert stats["pipeline_id"] == pid
        assert stats["kv_cache_usage"] == 0
        assert stats["num_running"] == stats["num_waiting"] == 0
        assert stats["inflight_microbatches"] == 0
        # The rebuilt stages carry the next generation's names; the old ones are all gone.
        for i, name in enumerate(names):
            ray.get_actor(f"ppserve-{pid}-g1-stage{i}", namespace=STAGE_NAMESPACE)
            with pytest.raises(ValueError):
                ray.get_actor(name, namespace=STAGE_NAMESPACE)
