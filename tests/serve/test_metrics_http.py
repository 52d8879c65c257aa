"""Prometheus metrics scraped from Ray's export port, and a mid-stream disconnect that frees
the request's KV blocks. A cluster of its own, so the request counts are exact."""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
import pytest

from tests.serve.conftest import ENGINE_ARGS, start_cluster, stop_cluster, wait_for

MODEL = "ppserve-random"
LONG_PROMPT = "pipeline parallel prefill in many chunks. " * 8  # ~340 tokens = 11 chunks
OUR_LABELS = (
    "finished_reason",
    "decision",
    "stage",
    "le",
    "phase",
    "kind",
    "dtype",
    "op",
    "backend",
    "reason",
    "dim",
)
PEAKS = {
    ("ray_ppserve_hardware_peak_flops_per_second", frozenset({("dtype", "bf16")})): 790e12,
    ("ray_ppserve_hardware_peak_flops_per_second", frozenset({("dtype", "fp8")})): 1580e12,
    ("ray_ppserve_hardware_peak_memory_bytes_per_second", frozenset()): 4.8e12,
}


@pytest.fixture(scope="module")
def served(fast_metrics):
    try:
        yield start_cluster({"ppserve": ("/", ENGINE_ARGS)})
    finally:
        stop_cluster()


def scrape(served) -> dict:
    """{(sample name, frozenset of our labels): value}, summed over Ray's own labels."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(served.metrics_url, timeout=10).text
    except httpx.HTTPError:
        return {}
    out: dict = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if not s.name.startswith("ray_ppserve_"):
                continue
            labels = frozenset((k, v) for k, v in s.labels.items() if k in OUR_LABELS)
            out[(s.name, labels)] = out.get((s.name, labels), 0.0) + s.value
    return out


def value(samples: dict, name: str, **labels) -> float:
    want = set(labels.items())
    return sum(
        v
        for (n, ls), v in samples.items()
        if n == name and want <= set(ls) and ("le" in labels or not any(k == "le" for k, _ in ls))
    )


def pool_is_free(served) -> bool:
    s = served.stats()
    if "kv_blocks_free" in s:
        return s["kv_blocks_free"] == s["kv_blocks_total"] and s["num_running"] == 0
    return s["kv_cache_usage"] == 0.0 and s["num_running"] == 0


def settled_scrape(served, names: tuple[str, ...], quiet_s: float = 3.0, timeout: float = 60.0):
    """A scrape after `names` stopped moving for `quiet_s` (six report intervals): Ray exports
    each worker's counters on its own clock, so an earlier test's decode steps can still arrive
    after the pool is free, and a "before" taken then would charge them to the next request."""
    last, since = None, time.monotonic()
    deadline = since + timeout
    while time.monotonic() < deadline:
        m = scrape(served)
        now = {n: value(m, n) for n in names}
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return m
        time.sleep(0.25)
    raise AssertionError(f"{names} never settled: {last}")


def documented_metrics() -> set[str]:
    """The series README's Metrics section names (`ray_ppserve_x`, `..._x`)."""
    text = (Path(__file__).parents[2] / "README.md").read_text()
    section = text[text.index("### Metrics") : text.index("### Load test")]
    return {"ray_ppserve_" + m for m in re.findall(r"`(?:ray_ppserve_|\.\.\._)(\w+)", section)}


# Counters whose label values are unknown until their first event: like histograms, they appear
# with it.
FIRST_EVENT = {"ray_ppserve_kernel_fallbacks_total"}


def test_documented_metrics_at_zero_from_startup(served):
    """Before any request: every documented counter (each known label value) and gauge is
    exported at zero, but the GPU's peak rates, at their H200 defaults, and the pipeline's
    shape. Histograms are not: Ray
    exports one only once it is observed."""
    names = {n for n in documented_metrics() if not n.endswith("_seconds")} - FIRST_EVENT
    assert FIRST_EVENT <= documented_metrics()
    assert len(names) >= 17, names
    phases = ("phase", ("prefill", "decode"))
    labelled = {
        "ray_ppserve_request_success_total": (
            "finished_reason",
            ("stop", "length", "abort", "error"),
        ),
        "ray_ppserve_pp_output_comm_total": ("decision", ("sent", "skipped")),
        "ray_ppserve_model_flops_total": phases,
        "ray_ppserve_stage_busy_seconds_total": phases,
        "ray_ppserve_decode_read_bytes_total": ("kind", ("weights", "kv")),
        "ray_ppserve_parallel_size": ("dim", ("pipeline", "tensor")),
    }

    def exported(samples):
        have = {n for n, _ in samples}
        return all(n in have for n in names) and all(
            (n, frozenset({(k, v)})) in samples for n, (k, vs) in labelled.items() for v in vs
        )

    samples = wait_for(lambda: (m := scrape(served)) and exported(m) and m, timeout=30)
    assert samples, sorted(names - {n for n, _ in scrape(served)})
    nonzero = {k: v for k, v in samples.items() if k[0] in names and v != 0}
    shape = {  # the pipeline's: pp 2 (ENGINE_ARGS), no tensor parallelism
        ("ray_ppserve_parallel_size", frozenset({("dim", "pipeline")})): 2.0,
        ("ray_ppserve_parallel_size", frozenset({("dim", "tensor")})): 1.0,
    }
    assert nonzero == {**PEAKS, **shape}


def test_metrics_exported(served):
    c = served.client()
    c.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=4, temperature=0)
    c.completions.create(model=MODEL, prompt="short", max_tokens=6, temperature=0)
    list(
        c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5, stream=True
        )
    )
    served_requests = 3
    ttft = "ray_ppserve_time_to_first_token_seconds_count"
    samples = wait_for(
        lambda: (
            (m := scrape(served))
            and value(m, ttft) >= served_requests
            and value(m, "ray_ppserve_request_success_total") >= served_requests
            and m
        ),
        timeout=30,
    )
    assert samples, "ppserve metrics never reached the export port"
    assert value(samples, ttft) == served_requests
    assert value(samples, "ray_ppserve_e2e_request_latency_seconds_count") == served_requests
    assert value(samples, "ray_ppserve_request_queue_time_seconds_count") == served_requests
    assert value(samples, "ray_ppserve_request_success_total", finished_reason="length") == 3
    assert value(samples, "ray_ppserve_generation_tokens_total") == 4 + 6 + 5
    assert value(samples, "ray_ppserve_prompt_tokens_total") > 340
    assert value(samples, "ray_ppserve_inter_token_latency_seconds_count") == 3 + 5 + 4
    # The long prompt's mid-prompt chunks skipped the output channel.
    assert value(samples, "ray_ppserve_pp_output_comm_total", decision="skipped") >= 10
    assert value(samples, "ray_ppserve_pp_output_comm_total", decision="sent") >= 1
    for stage in ("0", "1"):
        assert value(samples, "ray_ppserve_stage_forward_seconds_count", stage=stage) > 0
    ratio = ("ray_ppserve_pp_output_skip_hit_ratio", frozenset())
    assert samples.get(ratio, 1.0) == 1.0  # auto misses nothing
    assert ("ray_ppserve_kv_cache_usage_perc", frozenset()) in samples
    # Every admitted prompt token was looked up in the prefix cache; three distinct prompts
    # share nothing.
    queries = value(samples, "ray_ppserve_prefix_cache_queries_total")
    assert queries == value(samples, "ray_ppserve_prompt_tokens_total")
    assert value(samples, "ray_ppserve_prefix_cache_hits_total") == 0
    stats = served.stats()
    assert stats["prefix_cache_queries"] == queries and stats["prefix_cache_hits"] == 0
    # The TTFT histogram's buckets reach minutes (long prompts).
    assert value(samples, "ray_ppserve_time_to_first_token_seconds_bucket", le="640.0") == 3


def test_kernel_fallbacks_reach_the_metrics(served):
    """A fallback counted in a stage's process (here recorded there by hand: a CPU stage has
    only torch backends) rides its next StepResult to the coordinator, into
    ray_ppserve_kernel_fallbacks_total{op,backend,reason} and the stats."""
    import ray

    from app.pipeline import STAGE_NAMESPACE

    last = [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == STAGE_NAMESPACE and a["name"].endswith("-stage1")
    ]
    assert len(last) == 1, last

    def fall_back(_stage):
        from stages.kernels.fallbacks import record_fallback

        for _ in range(3):
            record_fallback("attention", "cudnn", "few_rows", "recorded by the test")

    ray.get(ray.get_actor(last[0], namespace=STAGE_NAMESPACE).__ray_call__.remote(fall_back))
    served.client().completions.create(model=MODEL, prompt="x", max_tokens=2)
    name, labels = (
        "ray_ppserve_kernel_fallbacks_total",
        dict(op="attention", backend="cudnn", reason="few_rows"),
    )
    got = wait_for(lambda: value(scrape(served), name, **labels) or None, timeout=30)
    assert got == 3
    assert served.stats()["kernel_fallbacks"] == {"attention/cudnn/few_rows": 3}


def test_gauges_kept_while_idle(served):
    """Idle for several export intervals (0.5 s here; Ray drops a gauge left unrecorded for
    two), the load gauges are still exported, at zero."""
    gauges = (
        "ray_ppserve_num_requests_running",
        "ray_ppserve_num_requests_waiting",
        "ray_ppserve_kv_cache_usage_perc",
        "ray_ppserve_pp_output_skip_hit_ratio",
    )
    assert wait_for(lambda: pool_is_free(served), timeout=30)
    time.sleep(5)
    samples = scrape(served)
    for name in gauges:
        assert (name, frozenset()) in samples, name
    assert {k: samples.get(k) for k in PEAKS} == PEAKS
    assert value(samples, "ray_ppserve_num_requests_running") == 0
    assert value(samples, "ray_ppserve_num_requests_waiting") == 0


def test_skip_counters_move_with_long_prompts(served):
    before = value(scrape(served), "ray_ppserve_pp_output_comm_total", decision="skipped")
    # another first token: nothing of the earlier long prompt is a cached prefix of this one
    served.client().completions.create(model=MODEL, prompt="Then " + LONG_PROMPT, max_tokens=2)
    after = wait_for(
        lambda: (
            (v := value(scrape(served), "ray_ppserve_pp_output_comm_total", decision="skipped"))
            >= before + 10
            and v
        ),
        timeout=30,
    )
    assert after and after >= before + 10


def test_prefix_cache_hits_are_counted(served):
    """The long prompt again: all its full 16-token blocks but the last token's are hits."""
    before = settled_scrape(
        served, ("ray_ppserve_prefix_cache_hits_total", "ray_ppserve_prefix_cache_queries_total")
    )
    hits0 = value(before, "ray_ppserve_prefix_cache_hits_total")
    queries0 = value(before, "ray_ppserve_prefix_cache_queries_total")
    out = served.client().completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=2)
    n = out.usage.prompt_tokens
    cached = (n - 1) // 16 * 16
    samples = wait_for(
        lambda: (
            (m := scrape(served))
            and value(m, "ray_ppserve_prefix_cache_queries_total") >= queries0 + n
            and m
        ),
        timeout=30,
    )
    assert samples, "the prefix cache counters never moved"
    assert value(samples, "ray_ppserve_prefix_cache_queries_total") == queries0 + n
    assert value(samples, "ray_ppserve_prefix_cache_hits_total") == hits0 + cached


def test_model_work_counted(served):
    """One request's FLOPs and decode reads, by hand: the built-in model (hidden 128, MLP 256,
    4 heads and 2 KV heads of 32, 4 layers, vocab 320) in float32. Each processed position p
    computes every weight twice and attends p + 1 keys; each sampled token runs the LM head; a
    decode step reads every weight and its row's keys. The stages' busy time grows too."""
    names = (
        "ray_ppserve_model_flops_total",
        "ray_ppserve_decode_read_bytes_total",
        "ray_ppserve_stage_busy_seconds_total",
    )

    assert wait_for(lambda: pool_is_free(served), timeout=30)
    before = settled_scrape(served, names)
    prompt, generated = 70, 5  # chunks of 32, 32, 6 (no cached prefix), then 4 decode steps
    out = served.client().completions.create(
        model=MODEL,
        prompt=list(range(1, prompt + 1)),
        max_tokens=generated,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (prompt, generated)
    layers, weights = 4, 128 * 4 * 32 + 2 * 128 * 2 * 32 + 4 * 32 * 128 + 3 * 128 * 256
    token, pair, head = 2 * weights * layers, 4 * 4 * 32 * layers, 2 * 128 * 320
    keys = sum(p + 1 for p in range(prompt, prompt + generated - 1))  # of the decode rows
    prefill = token * prompt + pair * prompt * (prompt + 1) / 2 + head
    decode = token * (generated - 1) + pair * keys + head * (generated - 1)
    read_weights = (generated - 1) * (layers * weights + 2 * 128 * 320) * 4
    read_kv = keys * layers * 2 * 2 * 32 * 4
    flops0 = value(before, names[0])
    after = wait_for(
        lambda: (
            (m := scrape(served))
            and value(m, names[0]) >= flops0 + (prefill + decode) * (1 - 1e-9)
            # Ray exports each metric on its own: wait for every one of them
            and value(m, names[1])
            >= value(before, names[1]) + (read_weights + read_kv) * (1 - 1e-9)
            and all(
                value(m, names[2], phase=p) > value(before, names[2], phase=p)
                for p in ("prefill", "decode")
            )
            and m
        ),
        timeout=30,
    )
    assert after, "the work counters never moved"

    def grew(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert grew(names[0], phase="prefill") == pytest.approx(prefill)
    assert grew(names[0], phase="decode") == pytest.approx(decode)
    assert grew(names[1], kind="weights") == pytest.approx(read_weights)
    assert grew(names[1], kind="kv") == pytest.approx(read_kv)
    for phase in ("prefill", "decode"):
        assert grew(names[2], phase=phase) > 0


def test_disconnect_mid_stream_frees_blocks(served):
    assert wait_for(lambda: pool_is_free(served), timeout=30)
    body = {
        "model": MODEL,
        "prompt": LONG_PROMPT,
        "max_tokens": 160,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{served.base_url}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(3)]  # a few tokens are out: the request is running
        assert all(line.startswith("data: ") or not line for line in got)
        s = served.stats()
        assert s["num_running"] == 1
    # The connection is closed: the request is aborted and its blocks return to the pool.
    assert wait_for(lambda: pool_is_free(served), timeout=30), served.stats()
    aborted = wait_for(
        lambda: value(scrape(served), "ray_ppserve_request_success_total", finished_reason="abort"),
        timeout=30,
    )
    assert aborted == 1
    # The server still serves.
    r = served.client().completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert r.usage.completion_tokens == 2


def server_log_problems() -> list[str]:
    """Lines of this cluster's Serve replica logs (and worker stderr) that a cancelled request
    must never leave: tracebacks, unretrieved task exceptions, 500/503 answers."""
    import ray

    logs = Path(ray._private.worker._global_node.get_session_dir_path()) / "logs"
    bad = ("Traceback", "exception was never retrieved", " 500 ", " 503 ", "Request failed")
    files = [*(logs / "serve").glob("replica_*.log"), *logs.glob("worker-*.err")]
    return [
        line
        for f in files
        for line in f.read_text(errors="replace").splitlines()
        if any(b in line for b in bad)
    ]


def test_cancelled_burst_frees_everything(served):
    """Clients that time out (as the openai client does: 0.5 s, two retries) while their
    requests are queued at the ingress, wait for admission, prefill or decode, and streams
    closed mid-way: afterwards nothing runs or waits, every KV block is free, and the next
    request is served."""
    import asyncio

    import openai

    assert wait_for(lambda: pool_is_free(served), timeout=30)

    async def burst() -> list[str]:
        impatient = openai.AsyncOpenAI(
            base_url=f"{served.base_url}/v1", api_key="x", timeout=0.5, max_retries=2
        )
        client = served.async_client()

        async def timed_out(i: int) -> str:
            try:  # prompt + max_tokens fill the context: at most a few are admitted at once
                await impatient.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": f"hi {i}"}],
                    max_tokens=400,
                    extra_body={"ignore_eos": True},
                )
            except openai.APITimeoutError:
                return "timeout"
            return "served"

        async def closed_mid_stream(i: int) -> str:
            stream = await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": f"stream {i}"}],
                max_tokens=400,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            got = 0
            async for _ in stream:
                got += 1
                if got == 3:
                    break
            await stream.close()
            return "closed"

        return await asyncio.gather(
            *[timed_out(i) for i in range(40)], *[closed_mid_stream(i) for i in range(3)]
        )

    outcomes = asyncio.run(burst())
    # (a machine fast enough to serve some within their timeouts still tests the rest)
    assert outcomes.count("timeout") > 0 and outcomes.count("closed") == 3, outcomes

    def idle():
        s = served.stats()
        return (
            s["num_running"] == 0
            and s["num_waiting"] == 0
            and s["kv_blocks_free"] == s["kv_blocks_total"]
            and s["slots_free"] == 16
            and s
        )

    assert wait_for(idle, timeout=60), served.stats()
    r = served.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert r.usage.completion_tokens == 3
    assert not server_log_problems()
