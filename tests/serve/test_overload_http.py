"""Overload over real HTTP (loopback, bounded): --max-waiting-requests bounds the queue and
refuses the rest with 429 + Retry-After; on-demand KV admission on a pool too small for every
running request preempts and recomputes instead of failing. Three rounds of the same flood:
every request gets 200 or 429, every 200 is complete and equal to the same request run alone,
the block pool comes back full, and the cluster's processes and each actor's RSS stay put."""

from __future__ import annotations

import asyncio
import random

import psutil
import pytest

from tests.serve.conftest import ENGINE_ARGS, start_cluster, stop_cluster, wait_for
from tests.serve.flood import flood, sequential
from tests.serve.test_metrics_http import scrape, value

# N: 16 requests at once against room for MAX_SEQS + MAX_WAITING = 10, so each round refuses
# some (6) and serves the rest; 32 refused more of them to the same effect, and their run alone
# (the reference, one request at a time) cost ~15 s more.
MAX_SEQS, MAX_WAITING, N = 4, 6, 16
# 20 blocks of 16 tokens: four running requests of up to 40 + 90 tokens (9 blocks each) do not
# fit together, so on-demand admission must preempt, mostly requests already decoding.
OVERLOAD_ARGS = {**ENGINE_ARGS, "max_num_seqs": MAX_SEQS, "max_waiting_requests": MAX_WAITING,
                 "kv_admission": "on-demand", "num_kv_blocks": 20}
RSS_SLACK = 1.25  # a round may not grow an actor past this much of its size after round 1


def bodies() -> list[dict]:
    rng = random.Random(15)
    out = []
    for i in range(N):
        words = " ".join(rng.choice(["pipe", "stage", "chunk", "token", "ray", "kv"])
                         for _ in range(rng.randint(3, 6)))
        body = {"prompt": f"{i}: {words}", "max_tokens": rng.randint(30, 90),
                "temperature": 0, "ignore_eos": True}
        if i % 2 == 0:
            body.update(stream=True, stream_options={"include_usage": True})
        out.append(body)
    return out


@pytest.fixture(scope="module")
def served(fast_metrics):
    try:
        yield start_cluster({"ppserve": ("/", OVERLOAD_ARGS)})
    finally:
        stop_cluster()


def snapshot() -> tuple[dict[str, int], int]:
    """RSS of each actor process (by its Ray process title and pid), and how many processes
    this cluster runs: the test process started it, so all of them descend from it."""
    procs = psutil.Process().children(recursive=True)
    rss, live = {}, 0
    for p in procs:
        try:  # a process may exit (or be a zombie awaiting its reaper) between list and read
            cmdline = p.cmdline()
            memory = p.memory_info().rss
        except psutil.Error:
            continue
        live += 1
        # "ray::ServeReplica:app:PipelineServer.generate": the actor, then the running method
        title = (cmdline or [""])[0].split()[0].split(".")[0] if cmdline else ""
        if title.startswith("ray::") and title != "ray::IDLE":
            rss[f"{title}:{p.pid}"] = memory
    return rss, live


def settle(served) -> dict:
    def idle():
        s = served.stats()
        return s if s["num_running"] == s["num_waiting"] == s["inflight_microbatches"] == 0 \
            else None

    stats = wait_for(idle, timeout=60)
    assert stats, served.stats()
    return stats


def test_flood_rounds(served):
    reqs = bodies()
    alone = asyncio.run(sequential(served.base_url, reqs))
    assert all(r.status == 200 and r.completion_tokens == b["max_tokens"]
               for r, b in zip(alone, reqs))
    snapshots, figures = [], []
    for _round in range(3):
        replies = asyncio.run(flood(served.base_url, reqs))
        statuses = [r.status for r in replies]
        assert set(statuses) <= {200, 429}, statuses
        assert 429 in statuses and 200 in statuses, statuses
        for reply, want, body in zip(replies, alone, reqs):
            if reply.status == 429:
                assert reply.retry_after is not None and int(reply.retry_after) >= 1
                assert reply.error["type"] == "rate_limit_exceeded"
                assert "overloaded" in reply.error["message"]
                continue
            assert reply.done and reply.error is None, reply
            assert reply.finish_reason == "length"
            assert reply.completion_tokens == body["max_tokens"]
            assert reply.text == want.text
        stats = settle(served)
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"] == 20
        snapshots.append(snapshot())
        figures.append((statuses.count(200), statuses.count(429), stats["num_preemptions"]))
    print(f"overload rounds (200s, 429s, preemptions so far): {figures}")
    assert figures[-1][2] > 0  # the small pool forced recomputation, and nothing failed
    (rss1, procs1), (rss2, procs2), (rss3, procs3) = snapshots
    print(f"overload processes per round: {procs1}, {procs2}, {procs3}; actor RSS MiB: "
          f"{[{k: v >> 20 for k, v in s.items()} for s, _ in snapshots]}")
    assert set(rss1) == set(rss2) == set(rss3)  # no actor died, restarted or was added
    assert procs1 == procs2 == procs3
    for key, size in rss3.items():
        assert size <= rss1[key] * RSS_SLACK, (key, rss1[key], size)


def test_exported_skip_counters_equal_stats_after_preemptions(served):
    """Preemptions inside schedule() orphan sends too; Prometheus must count them as stats()."""
    comm = served.stats()["pp_output_comm"]
    assert served.stats()["num_preemptions"] > 0 and comm["sent"] > 0

    def exported():
        s = scrape(served)
        got = {"sent": value(s, "ray_ppserve_pp_output_comm_total", decision="sent"),
               "skipped": value(s, "ray_ppserve_pp_output_comm_total", decision="skipped"),
               "missed": value(s, "ray_ppserve_pp_output_comm_missed_total"),
               "orphaned": value(s, "ray_ppserve_pp_output_comm_orphaned_total")}
        return got if got == comm else None

    assert wait_for(exported, timeout=30), (comm, scrape(served))
    print(f"overload output channel counters: {comm}")
