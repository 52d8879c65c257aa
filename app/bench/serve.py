"""`ppserve bench serve`: a load client for a running OpenAI endpoint, like `vllm bench serve`.

Poisson arrivals at each request rate, a mix of (long) prompt and output lengths, streaming
requests; reports TTFT, inter-token latency, end-to-end latency, throughput and errors per rate.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
from tqdm import tqdm


@dataclass
class Result:
    ok: bool
    prompt_len: int
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


PromptCase = tuple[list[int] | str, int, int]  # (prompt, prompt length, output length)


def make_prompts(a: argparse.Namespace, rng: random.Random) -> list[PromptCase]:
    """(prompt, prompt length, output length) per request; lengths drawn from the mixes."""
    out: list[PromptCase] = []
    for _ in range(a.num_prompts):
        n, m = rng.choice(a.input_lens), rng.choice(a.output_lens)
        ids = [rng.randrange(a.token_id_min, a.token_id_max) for _ in range(n)]
        out.append((ids if a.prompt_kind == "tokens" else "".join(map(chr, ids)), n, m))
    return out


async def one_request(client: httpx.AsyncClient, a: argparse.Namespace, prompt: list[int] | str,
                      n: int, m: int) -> Result:
    body: dict[str, Any] = {
        "model": a.model, "max_tokens": m, "stream": True, "temperature": a.temperature,
        "ignore_eos": a.ignore_eos, "stream_options": {"include_usage": True}}
    if a.endpoint == "chat":
        text = prompt if isinstance(prompt, str) else "".join(map(chr, prompt))
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": text}]
    else:
        path, body["prompt"] = "/v1/completions", prompt
    res, start, last = Result(False, n), time.perf_counter(), None
    try:
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = str(chunk["error"].get("message"))
                    return res
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                for c in chunk.get("choices", ()):
                    if c.get("text") or (c.get("delta") or {}).get("content"):
                        now = time.perf_counter()
                        if last is None:
                            res.ttft = now - start
                        else:
                            res.itl.append(now - last)
                        last = now
        res.latency, res.ok = time.perf_counter() - start, True
    except (httpx.HTTPError, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run_rate(a: argparse.Namespace, rate: float,
                   prompts: list[PromptCase]) -> dict[str, Any]:
    rng = random.Random(a.seed)
    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    limits = httpx.Limits(max_connections=a.max_concurrency or len(prompts) + 1)
    progress = tqdm(total=len(prompts), desc=f"rate {rate:g} req/s", file=sys.stderr)
    sem = asyncio.Semaphore(a.max_concurrency or len(prompts))

    async def limited(client: httpx.AsyncClient, p: list[int] | str, n: int, m: int) -> Result:
        async with sem:
            res = await one_request(client, a, p, n, m)
        progress.update(1)
        return res

    async with httpx.AsyncClient(base_url=a.base_url, headers=headers, limits=limits,
                                 timeout=httpx.Timeout(a.timeout)) as client:
        start, tasks = time.perf_counter(), []
        for p, n, m in prompts:
            tasks.append(asyncio.create_task(limited(client, p, n, m)))
            if math.isfinite(rate):
                await asyncio.sleep(rng.expovariate(rate))  # Poisson arrivals
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    progress.close()
    return summarize(rate, results, duration)


def summarize(rate: float, results: list[Result], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    itl = [x for r in ok for x in r.itl]
    out_tokens = sum(r.output_tokens for r in ok)
    ms = 1000.0
    return {
        "request_rate": rate, "completed": len(ok), "errors": len(results) - len(ok),
        "error_samples": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration, "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "input_throughput": sum(r.prompt_len for r in ok) / duration,
        "total_output_tokens": out_tokens,
        "ttft_ms_mean": sum(r.ttft for r in ok) / len(ok) * ms if ok else float("nan"),
        "ttft_ms_p50": percentile([r.ttft for r in ok], 50) * ms,
        "ttft_ms_p99": percentile([r.ttft for r in ok], 99) * ms,
        "itl_ms_p50": percentile(itl, 50) * ms, "itl_ms_p99": percentile(itl, 99) * ms,
        "e2e_ms_p50": percentile([r.latency for r in ok], 50) * ms,
        "e2e_ms_p99": percentile([r.latency for r in ok], 99) * ms,
        "requests": [asdict(r) | {"itl": None} for r in results],
    }


# The server's skip counters (Prometheus names as Ray exports them): decision label or None.
COMM_SAMPLES = {"sent": ("ray_ppserve_pp_output_comm_total", "sent"),
                "skipped": ("ray_ppserve_pp_output_comm_total", "skipped"),
                "missed": ("ray_ppserve_pp_output_comm_missed_total", None),
                "orphaned": ("ray_ppserve_pp_output_comm_orphaned_total", None)}


def comm_counts(metrics_url: str) -> dict[str, float] | None:
    """sent / skipped / missed / orphaned so far, summed over replicas; None if unreachable."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(metrics_url, timeout=10).text
    except httpx.HTTPError:
        return None
    out = dict.fromkeys(COMM_SAMPLES, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for key, (name, decision) in COMM_SAMPLES.items():
                if sample.name == name and decision in (None, sample.labels.get("decision")):
                    out[key] += sample.value
    return out


def comm_delta(before: dict[str, float] | None,
               after: dict[str, float] | None) -> dict[str, Any]:
    if before is None or after is None:
        return {"pp_output_comm": None, "skip_hit_ratio": None}
    comm = {k: int(after[k] - before[k]) for k in COMM_SAMPLES}
    decided = comm["skipped"] + comm["missed"]
    ratio = comm["skipped"] / decided if decided else None
    return {"pp_output_comm": comm, "skip_hit_ratio": ratio}


def print_table(rows: list[dict[str, Any]]) -> None:
    cols = [("rate", "request_rate", "g"), ("ok", "completed", "d"), ("err", "errors", "d"),
            ("req/s", "request_throughput", ".2f"), ("out tok/s", "output_throughput", ".1f"),
            ("TTFT p50 ms", "ttft_ms_p50", ".1f"), ("TTFT p99 ms", "ttft_ms_p99", ".1f"),
            ("ITL p50 ms", "itl_ms_p50", ".1f"), ("ITL p99 ms", "itl_ms_p99", ".1f"),
            ("E2E p99 ms", "e2e_ms_p99", ".1f")]
    cells = [[format(r[k], f) for _, k, f in cols] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, (h, _, _) in enumerate(cols)]
    print("  ".join(h.rjust(w) for (h, _, _), w in zip(cols, widths)))
    for c in cells:
        print("  ".join(v.rjust(w) for v, w in zip(c, widths)))
    for r in rows:
        for e in r["error_samples"]:
            print(f"rate {r['request_rate']:g}: error: {e}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="ppserve bench serve", description=__doc__)
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="Server root (no /v1).")
    p.add_argument("--model", default=None, help="Model name (default: the server's first).")
    p.add_argument("--api-key", default=None, help="Bearer key, when the server wants one.")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--request-rates", type=float, nargs="+", default=[1.0, float("inf")],
                   help="Requests per second, one run each (inf: all at once).")
    p.add_argument("--num-prompts", type=int, default=16, help="Requests per rate.")
    p.add_argument("--input-lens", type=int, nargs="+", default=[1024, 4096],
                   help="Prompt lengths in tokens; each request draws one.")
    p.add_argument("--output-lens", type=int, nargs="+", default=[32],
                   help="Output lengths in tokens; each request draws one.")
    p.add_argument("--prompt-kind", choices=("tokens", "text"), default="tokens",
                   help="tokens: random token-id prompts (exact lengths); text: random "
                   "characters (exact with the byte tokenizer only).")
    p.add_argument("--token-id-min", type=int, default=32, help="Random ids from here ...")
    p.add_argument("--token-id-max", type=int, default=127, help="... to here (exclusive); "
                   "32-126 is printable ASCII in the built-in byte tokenizer.")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="Generate exactly the output length (default on).")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max-concurrency", type=int, default=None, help="Cap on open requests.")
    p.add_argument("--timeout", type=float, default=1800.0, help="Per request, seconds.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="Write the results as JSON here.")
    p.add_argument("--metrics-url", default=None, help="The server's Prometheus endpoint (e.g. "
                   "http://127.0.0.1:8080/metrics): record the output channel's sent / skipped /"
                   " missed / orphaned counts and the skip-hit ratio of each rate.")
    p.add_argument("--metrics-wait", type=float, default=15.0, help="Seconds to wait after a "
                   "rate before reading the counters (Ray exports every 10 s by default).")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(sys.argv[1:] if argv is None else argv)
    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    if a.model is None:
        r = httpx.get(f"{a.base_url}/v1/models", headers=headers, timeout=30)
        r.raise_for_status()
        a.model = r.json()["data"][0]["id"]
    prompts = make_prompts(a, random.Random(a.seed))
    rows = []
    for rate in a.request_rates:
        before = comm_counts(a.metrics_url) if a.metrics_url else None
        row = asyncio.run(run_rate(a, rate, prompts))
        if a.metrics_url:
            time.sleep(a.metrics_wait)  # Ray exports metrics every report interval
            row.update(comm_delta(before, comm_counts(a.metrics_url)))
            print(f"rate {rate:g}: output channel {row['pp_output_comm']}, skip-hit ratio "
                  f"{row['skip_hit_ratio']}")
        rows.append(row)
    print_table(rows)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"args": {k: v for k, v in vars(a).items() if k != "api_key"},
                       "results": rows}, f, indent=2, default=str)
        print(f"wrote {a.out}")
    return 0 if all(r["errors"] == 0 for r in rows) else 1
