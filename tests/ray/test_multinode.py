"""A PP=3 pipeline across the nodes of a real multi-node Ray cluster (`ray.cluster_utils.Cluster`:
a head and three worker raylets on this machine, each with its own logical CPUs and a custom
resource naming it). STRICT_SPREAD puts each stage on a different node (with --tp 2, both ranks of
a stage on its node); greedy output matches the same pipeline packed on one node. A worker node
removed mid-request fails the requests in flight with a clear error; the pipeline is rebuilt when
a node can take the lost stage, and is out of service (503) when none can."""

from __future__ import annotations

import random
import time

import pytest

from app import Engine, EngineConfig, SamplingParams
from app.request import InvalidRequest
from tests.ray.local_cluster import LocalCluster

TIMEOUT = 120  # seconds: a hang fails the test instead of stalling the suite
LONG = 3000  # prompt tokens; chunks of 16 -> ~190 microbatches of prefill
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
BASE = dict(pp_size=3, device="cpu", chunk_size=16, block_size=16, max_num_seqs=1,
            stage_num_cpus=1, num_kv_blocks=256, channel_check=True)


def _prompt(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(0, 256) for _ in range(n)]


@pytest.fixture(scope="module")
def cluster():
    c = LocalCluster(head_cpus=4, worker_cpus=[1, 1, 1])
    yield c
    c.shutdown()


def _coordinator_node(engine) -> str:
    return engine.info["coordinator_node_id"]


def _wait_for(engine, pred, what):
    deadline = time.time() + TIMEOUT
    while time.time() < deadline:
        stats = engine.stats()
        if pred(stats):
            return stats
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}: {engine.stats()}")


def _start_long_request(engine, short):
    """A long prefill in flight and two short requests queued behind it (max_num_seqs=1)."""
    import ray

    long_ref = engine._actor.generate_batch.remote([_prompt(LONG, 0)], [GREEDY])
    _wait_for(engine, lambda s: s["num_running"] == 1, "the long request to start")
    waiting_ref = engine._actor.generate_batch.remote(short, [GREEDY] * 2)
    _wait_for(engine, lambda s: s["num_waiting"] == 2, "two requests waiting")
    assert not ray.wait([long_ref], timeout=0)[0], "the long request finished: raise LONG"
    return long_ref, waiting_ref


def _victim(cluster, stages) -> tuple[int, str]:
    """A stage on a worker node (the head cannot be removed)."""
    return next((s["stage"], s["node_id"]) for s in stages if s["node_id"] in cluster.workers)


SHORT = [_prompt(20, seed) for seed in (1, 2)]


@pytest.fixture(scope="module")
def one_node_tokens(cluster):
    with Engine(EngineConfig(**BASE, placement_strategy="STRICT_PACK")) as engine:
        nodes = {s["node_id"] for s in engine.info["stages"]} | {_coordinator_node(engine)}
        assert len(nodes) == 1
        return [o.token_ids for o in engine.generate(SHORT, GREEDY)]


def test_stages_on_different_nodes_match_one_node(cluster, one_node_tokens):
    with Engine(EngineConfig(**BASE, placement_strategy="STRICT_SPREAD")) as engine:
        stages = engine.info["stages"]
        names = cluster.node_names()
        placed = [names[s["node_id"]] for s in stages] + [names[_coordinator_node(engine)]]
        assert sorted(placed) == ["head", "w0", "w1", "w2"], placed  # one bundle per node
        # The channels met at stage 0's node address (all raylets share this host's address).
        assert {s["node_ip"] for s in stages} == {stages[0]["node_ip"]}
        outs = engine.generate(SHORT, GREEDY)
        assert [o.finish_reason for o in outs] == ["length", "length"]
        assert [o.token_ids for o in outs] == one_node_tokens


def test_tensor_parallel_stages_across_nodes(cluster, one_node_tokens):
    """PP=3 x TP=2: each stage's two ranks share a node (its bundle), the stages and the
    coordinator spread over the four nodes, and the greedy tokens are the unsplit pipeline's."""
    cfg = EngineConfig(**{**BASE, "stage_num_cpus": 0.5}, tp_size=2,
                       placement_strategy="STRICT_SPREAD")
    with Engine(cfg) as engine:
        names = cluster.node_names()
        nodes = [{names[r["node_id"]] for r in s["ranks"]} for s in engine.info["stages"]]
        assert all(len(n) == 1 for n in nodes), nodes
        placed = [n.pop() for n in nodes] + [names[_coordinator_node(engine)]]
        assert sorted(placed) == ["head", "w0", "w1", "w2"], placed
        assert [o.token_ids for o in engine.generate(SHORT, GREEDY)] == one_node_tokens


def test_node_lost_mid_request_rebuilds_on_a_new_node(cluster, one_node_tokens):
    import ray

    cfg = EngineConfig(**BASE, placement_strategy="STRICT_SPREAD", placement_timeout_s=90)
    with Engine(cfg) as engine:
        victim, node_id = _victim(cluster, engine.info["stages"])
        long_ref, waiting_ref = _start_long_request(engine, SHORT)

        cluster.remove_worker(node_id)
        cluster.add_worker("w3")  # the lost stage's bundle is placed again on this node

        [failed] = ray.get(long_ref, timeout=TIMEOUT)
        assert failed.finish_reason == "error"
        assert "pipeline failed" in failed.error and "restarted" in failed.error, failed.error
        waited = ray.get(waiting_ref, timeout=TIMEOUT)  # queued requests lose nothing
        assert [o.error for o in waited] == [None, None]
        assert [o.token_ids for o in waited] == one_node_tokens

        stats = engine.stats()
        assert stats["pipeline_failures"] == 1
        pid = stats["pipeline_id"]
        rebuilt = ray.get([ray.get_actor(f"ppserve-{pid}-g1-stage{i}", namespace="ppserve")
                           .describe.remote() for i in range(3)])
        names = cluster.node_names()
        assert names[rebuilt[victim]["node_id"]] == "w3"
        assert len({s["node_id"] for s in rebuilt}) == 3
        assert [o.token_ids for o in engine.generate(SHORT, GREEDY)] == one_node_tokens


def test_node_lost_without_spare_capacity_is_a_clear_503(cluster):
    import ray

    cfg = EngineConfig(**BASE, placement_strategy="STRICT_SPREAD", placement_timeout_s=2)
    with Engine(cfg) as engine:
        _victim_stage, node_id = _victim(cluster, engine.info["stages"])
        long_ref, waiting_ref = _start_long_request(engine, SHORT)

        cluster.remove_worker(node_id)  # 3 nodes left: STRICT_SPREAD of 4 bundles cannot fit

        [failed] = ray.get(long_ref, timeout=TIMEOUT)
        assert failed.finish_reason == "error" and "pipeline failed" in failed.error
        # After the rebuild attempts the queued requests fail with the reason, not a hang.
        waited = ray.get(waiting_ref, timeout=TIMEOUT)
        for out in waited:
            assert out.finish_reason == "error"
            assert "could not be rebuilt" in out.error and "do not fit" in out.error, out.error
        with pytest.raises(Exception) as info:
            engine.generate(SHORT[:1], GREEDY)
        cause = info.value.cause if hasattr(info.value, "cause") else info.value
        assert isinstance(cause, InvalidRequest) and cause.status == 503, info.value
        assert "could not be rebuilt" in str(cause)
