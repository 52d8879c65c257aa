"""Faults through the Serve app, over real HTTP with the official openai client, on a PP=3
pipeline with run-ahead decoding and on-demand KV admission on a pool small enough to preempt:

- a stage killed (`ray.kill`) while requests stream in decode: every stream ends with an error
  event that names the stage but no Ray internals, /health answers 503 "degraded" while the
  pipeline is rebuilt, the rebuild is counted in Prometheus, and the next request is
  token-identical to before;
- the output-channel counters exported to Prometheus equal `stats()` after preemptions and the
  rebuild;
- the PipelineServer replica killed: the ingress answers 503 with an OpenAI error JSON while
  Serve replaces it, then serves the same tokens again.
"""

from __future__ import annotations

import asyncio
import random
import re
import threading
import time

import httpx
import openai
import pytest

from tests.serve.conftest import ENGINE_ARGS, start_cluster, stop_cluster, wait_for
from tests.serve.flood import flood, sequential
from tests.serve.test_metrics_http import scrape, value

MODEL = "ppserve-random"
# 16 blocks of 16 tokens for 4 running requests of up to 10 + 150 tokens (10 blocks each):
# on-demand admission must preempt and recompute.
FAULT_ARGS = {**ENGINE_ARGS, "pp": 3, "run_ahead": True, "kv_admission": "on-demand",
              "num_kv_blocks": 16, "max_num_seqs": 4, "stage_num_cpus": 0.5}
# What a client must never see: Ray's actor ids, pids, addresses, node ids, tracebacks.
INTERNALS = ("actor", "pid", "Traceback", "ip:", "node", "ray::", "File \"", "namespace")
TIMEOUT = 120


@pytest.fixture(scope="module")
def served(fast_metrics):
    try:
        yield start_cluster({"ppserve": ("/", FAULT_ARGS)})
    finally:
        stop_cluster()


def _stage(served, index: int):
    import ray

    from app.pipeline import STAGE_NAMESPACE

    s = served.stats()
    generation = s["pipeline_failures"]  # one rebuild per failure
    name = f"ppserve-{s['pipeline_id']}{f'-g{generation}' if generation else ''}-stage{index}"
    return ray.get_actor(name, namespace=STAGE_NAMESPACE)


def _idle(served) -> dict:
    def check():
        s = served.stats()
        return s if s["num_running"] == s["num_waiting"] == s["inflight_microbatches"] == 0 \
            else None

    stats = wait_for(check, timeout=TIMEOUT)
    assert stats, served.stats()
    return stats


def _assert_public(message: str, *secrets: str) -> None:
    for word in (*INTERNALS, *secrets):
        assert word not in message, (word, message)


def _greedy(served, prompt: str = "after the fault", max_tokens: int = 12) -> str:
    out = served.client().completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                             temperature=0, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == max_tokens
    return out.choices[0].text


class HealthWatch(threading.Thread):
    """Polls /health until it is 200 again after a non-200 (or `timeout`)."""

    def __init__(self, base_url: str, timeout: float = TIMEOUT):
        super().__init__(daemon=True)
        self.url, self.timeout = f"{base_url}/health", timeout
        self.seen: list[tuple[int, dict]] = []
        self.stop = threading.Event()

    def run(self):
        deadline = time.monotonic() + self.timeout
        while not self.stop.is_set() and time.monotonic() < deadline:
            try:
                r = httpx.get(self.url, timeout=30)
                self.seen.append((r.status_code, r.json()))
            except httpx.HTTPError as e:
                self.seen.append((0, {"error": repr(e)}))
            if self.seen[-1][0] == 200 and any(code != 200 for code, _ in self.seen):
                return
            time.sleep(0.02)


def _bodies(n: int) -> list[dict]:
    rng = random.Random(5)
    return [{"prompt": f"{i}: " + " ".join(rng.choice(["pipe", "stage", "kv", "ray"])
                                           for _ in range(4)),
             "max_tokens": rng.randint(80, 150), "temperature": 0, "ignore_eos": True,
             "stream": i % 2 == 0} for i in range(n)]


@pytest.mark.slow
def test_preemption_keeps_outputs(served):
    """On-demand admission on the small pool preempts; every output equals its run alone."""
    reqs = _bodies(8)
    alone = asyncio.run(sequential(served.base_url, reqs))
    together = asyncio.run(flood(served.base_url, reqs))
    for a, t, body in zip(alone, together, reqs):
        assert a.status == t.status == 200 and t.error is None, (a, t)
        assert t.finish_reason == "length" and t.text == a.text, (t, a, body)
    stats = _idle(served)
    assert stats["num_preemptions"] > 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def _stream(client, prompt: str, max_tokens: int, first_token: threading.Event, record: dict):
    """One streaming request read to its end; `record` gets its tokens, error and end time."""
    record["text"] = ""
    try:
        stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                           temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        for chunk in stream:
            record["text"] += chunk.choices[0].text if chunk.choices else ""
            if record["text"]:
                first_token.set()
        record["finished"] = True
    except openai.APIError as e:
        record["error"] = e
    finally:
        record["ended"] = time.monotonic()


def test_stage_killed_mid_decode(served):
    import ray

    before = _greedy(served)
    victim = _stage(served, 1)
    victim_id = victim._actor_id.hex()
    victim_pid = str(ray.get(victim.describe.remote())["pid"])

    client = served.client()
    records = [{} for _ in range(3)]
    decoding = [threading.Event() for _ in records]
    threads = [threading.Thread(target=_stream, daemon=True, args=(
        client, f"stream {i}: a long decode", 200, decoding[i], records[i]))
        for i in range(len(records))]
    for t in threads:
        t.start()
    for ev in decoding:  # every stream is past its prompt and decoding
        assert ev.wait(TIMEOUT), records
    # Three requests of 13 blocks on a pool of 16: they preempt one another before the kill.
    preempted = served.stats()["num_preemptions"]
    assert wait_for(lambda: served.stats()["num_preemptions"] > preempted, timeout=TIMEOUT,
                    interval=0.02), served.stats()
    assert not any("ended" in rec for rec in records), records

    watch = HealthWatch(served.base_url)
    killed = time.monotonic()
    ray.kill(victim, no_restart=True)
    watch.start()
    for t in threads:
        t.join(TIMEOUT)
        assert not t.is_alive(), "a stream hung after the stage died"

    for rec in records:
        assert "finished" not in rec, rec  # no stream ran to its end
        err = rec["error"]
        message = err.message if isinstance(err, openai.APIError) else str(err)
        assert "pipeline failed" in message and "restarted" in message, message
        assert re.search(r"\(stage \d of 3 stopped\)", message), message
        _assert_public(message, victim_id, victim_pid)
        assert len(rec["text"]) > 0  # it had streamed tokens before the error
    print(f"stage kill: streams ended with an error event after "
          f"{[round(r['ended'] - killed, 3) for r in records]} s")

    after = _greedy(served)  # queued until the rebuild is done
    assert after == before
    watch.join(TIMEOUT)
    codes = [code for code, _ in watch.seen]
    assert 503 in codes and codes[-1] == 200, watch.seen
    for code, body in watch.seen:
        if code == 503:
            assert body["status"] in ("degraded", "unavailable"), body
            _assert_public(body.get("message") or "", victim_id, victim_pid)
    assert any(body.get("status") == "degraded" for _, body in watch.seen), watch.seen

    stats = _idle(served)
    assert stats["pipeline_failures"] == 1 and not stats["pipeline_rebuilding"]
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    rebuilds = wait_for(lambda: value(scrape(served), "ray_ppserve_pipeline_rebuilds_total"),
                        timeout=30)
    assert rebuilds == 1


def test_exported_counters_equal_stats_after_preemption_and_kill(served):
    """The streams above were preempted (and recomputed), then cut by the kill."""
    stats = _idle(served)
    assert stats["num_preemptions"] > 0 and stats["pipeline_failures"] == 1
    comm = stats["pp_output_comm"]

    def exported():
        s = scrape(served)
        got = {"sent": value(s, "ray_ppserve_pp_output_comm_total", decision="sent"),
               "skipped": value(s, "ray_ppserve_pp_output_comm_total", decision="skipped"),
               "missed": value(s, "ray_ppserve_pp_output_comm_missed_total"),
               "orphaned": value(s, "ray_ppserve_pp_output_comm_orphaned_total"),
               "rebuilds": value(s, "ray_ppserve_pipeline_rebuilds_total")}
        return got if got == {**comm, "rebuilds": 1} else None

    assert wait_for(exported, timeout=30), (comm, scrape(served))
    print(f"fault run counters: {comm}, preemptions {stats['num_preemptions']}")


def _post(served, body: dict) -> httpx.Response:
    return httpx.post(f"{served.base_url}/v1/completions", json=body, timeout=TIMEOUT)


def test_replica_killed_then_replaced(served):
    import ray

    before = _greedy(served, "replica", 6)
    old_pid = served.stats()["pipeline_id"]
    record, decoding = {}, threading.Event()
    streaming = threading.Thread(target=_stream, daemon=True, args=(
        served.client(), "cut short", 200, decoding, record))
    streaming.start()
    assert decoding.wait(TIMEOUT), record
    [replica] = [a for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["name"].startswith("SERVE_REPLICA::ppserve#PipelineServer")]
    handle = ray.get_actor(replica["name"], namespace=replica["namespace"])
    replica_id = handle._actor_id.hex()
    ray.kill(handle, no_restart=True)

    streaming.join(TIMEOUT)
    assert not streaming.is_alive() and "finished" not in record, record
    assert "restarting or unavailable" in record["error"].message, record
    _assert_public(record["error"].message, replica_id)

    body = {"model": MODEL, "prompt": "replica", "max_tokens": 6, "temperature": 0,
            "ignore_eos": True}
    health = httpx.get(f"{served.base_url}/health", timeout=TIMEOUT)
    assert health.status_code == 503 and health.json()["status"] == "unavailable", health.text
    _assert_public(health.json()["message"], replica_id)
    seen = []
    deadline = time.monotonic() + 3 * TIMEOUT
    while time.monotonic() < deadline:
        r = _post(served, body)
        seen.append(r.status_code)
        if r.status_code == 200:
            break
        assert r.status_code == 503, (r.status_code, r.text)
        err = r.json()["error"]
        assert err["type"] == "server_error" and "restarting or unavailable" in err["message"]
        assert r.headers.get("retry-after")
        _assert_public(err["message"], replica_id)
        time.sleep(0.2)
    print(f"replica kill: statuses until served again: {seen}")
    assert seen[-1] == 200 and 503 in seen, seen
    assert r.json()["choices"][0]["text"] == before
    assert served.stats()["pipeline_id"] != old_pid  # a new pipeline
    assert httpx.get(f"{served.base_url}/health", timeout=30).json() == {"status": "ok"}
