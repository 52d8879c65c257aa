"""`ppserve bench prefix`: what the prefix cache buys and costs, cache on vs off (issue 14).

docs     — a document of each --docs length, then --questions questions of --question-len tokens
           about it (each request: the whole document + its question): TTFT of the first request
           and of each following one.
chat     — a multi-turn chat replay: each of --chat-turns turns resends the whole history (every
           earlier user message and reply) plus a new user message, growing to about --chat-len
           tokens: TTFT per turn.
distinct — --distinct prompts of --distinct-len tokens sharing no prefix: TTFT each (the cache's
           overhead where it cannot help).

One pipeline is loaded per --cache setting (prefix caching on / off) and runs every part, one
request at a time. Every rep draws fresh random tokens, so each rep's first request is cold.
Each part first runs once unrecorded, a warm-up: with the cache on, a hit's chunk shapes (a
cached prefix and a few new tokens) are new to the attention kernels; with it off, the documents
are sent without their questions, which would only repeat the first request's shapes. Rows
record the prefix-cache hits and queries (tokens) of every request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from app.bench.target import (
    BenchEngine,
    add_model_args,
    engine_default,
    environment,
    start_local_ray,
    write_model,
)
from stages.protocol import DEVICES

PARTS = ("docs", "chat", "distinct")
Tokens = Callable[[int], list[int]]  # n -> n random token ids
MAX_TOKENS = 2  # as the other TTFT benches: one token out, the second needs it at stage 0


def _request(engine: BenchEngine, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """One request alone: its TTFT, its output and its prefix-cache counters."""
    from app.request import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    s0 = engine.wait_idle()
    ttft, tokens = asyncio.run(engine.timed(prompt, params))
    s1 = engine.wait_idle()
    return {
        "prompt_len": len(prompt),
        "ttft_s": ttft,
        "tokens": tokens,
        "hits": s1["prefix_cache_hits"] - s0["prefix_cache_hits"],
        "queries": s1["prefix_cache_queries"] - s0["prefix_cache_queries"],
    }


def _row(
    part: str, cache: str, rep: int, reqs: list[dict[str, Any]], **extra: Any
) -> dict[str, Any]:
    return {
        "part": part,
        "cache": cache,
        "rep": rep,
        **extra,
        "prompt_lens": [r["prompt_len"] for r in reqs],
        "ttft_s": [r["ttft_s"] for r in reqs],
        "prefix_hits": [r["hits"] for r in reqs],
        "prefix_queries": [r["queries"] for r in reqs],
    }


def run_docs(
    engine: BenchEngine, tokens: Tokens, a: argparse.Namespace, cache: str, rep: int
) -> list[dict[str, Any]]:
    rows = []
    for doc_len in a.docs:
        doc = tokens(doc_len)
        reqs = [
            _request(engine, doc + tokens(a.question_len), MAX_TOKENS)
            for _ in range(1 + a.questions)
        ]
        rows.append(_row("docs", cache, rep, reqs, doc_len=doc_len))
    return rows


def run_chat(
    engine: BenchEngine, tokens: Tokens, a: argparse.Namespace, cache: str, rep: int
) -> list[dict[str, Any]]:
    step = a.chat_len // a.chat_turns
    history: list[int] = []
    reqs = []
    for _ in range(a.chat_turns):
        history = history + tokens(max(1, step - a.chat_reply))
        r = _request(engine, history, a.chat_reply)
        history = history + r["tokens"]  # the reply is part of the next turn's history
        reqs.append(r)
    return [_row("chat", cache, rep, reqs)]


def run_distinct(
    engine: BenchEngine, tokens: Tokens, a: argparse.Namespace, cache: str, rep: int
) -> list[dict[str, Any]]:
    reqs = [_request(engine, tokens(a.distinct_len), MAX_TOKENS) for _ in range(a.distinct)]
    return [_row("distinct", cache, rep, reqs)]


RUNNERS = {"docs": run_docs, "chat": run_chat, "distinct": run_distinct}


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over reps: per document length the first and the following TTFTs, per chat turn,
    the distinct prompts'; cache on against off where both ran."""
    out: dict[str, Any] = {}
    docs: dict[str, Any] = {}
    for r in (r for r in rows if r["part"] == "docs"):
        d = docs.setdefault(str(r["doc_len"]), {}).setdefault(r["cache"], {"first": [], "next": []})
        d["first"].append(r["ttft_s"][0])
        d["next"] += r["ttft_s"][1:]
    for doc_len, by_cache in docs.items():
        s: dict[str, Any] = {
            c: {"first_ttft_s": _median(v["first"]), "next_ttft_s": _median(v["next"])}
            for c, v in by_cache.items()
        }
        if "on" in s and "off" in s and s["on"]["next_ttft_s"] and s["off"]["first_ttft_s"]:
            s["next_on_over_first_off"] = s["on"]["next_ttft_s"] / s["off"]["first_ttft_s"]
        docs[doc_len] = s
    if docs:
        out["docs"] = docs
    chat: dict[str, Any] = {}
    for r in (r for r in rows if r["part"] == "chat"):
        chat.setdefault(r["cache"], []).append(r["ttft_s"])
    if chat:
        out["chat"] = {
            c: {
                "turn_ttft_s": [_median(list(t)) for t in zip(*runs, strict=True)],
                "total_ttft_s": _median([sum(run) for run in runs]),
            }
            for c, runs in chat.items()
        }
    distinct: dict[str, Any] = {}
    for r in (r for r in rows if r["part"] == "distinct"):
        distinct.setdefault(r["cache"], []).extend(r["ttft_s"])
    if distinct:
        out["distinct"] = {
            c: {"ttft_median_s": _median(v), "n": len(v)} for c, v in distinct.items()
        }
        if "on" in distinct and "off" in distinct:
            out["distinct"]["on_over_off"] = (
                out["distinct"]["on"]["ttft_median_s"] / out["distinct"]["off"]["ttft_median_s"]
            )
    return out


def _print(summary: dict[str, Any]) -> None:
    for doc_len, s in summary.get("docs", {}).items():
        for c in ("off", "on"):
            if c in s:
                print(
                    f"docs {doc_len:>7s} cache {c:3s}: first {s[c]['first_ttft_s']:.3f}s  "
                    f"next {s[c]['next_ttft_s']:.3f}s"
                )
        if "next_on_over_first_off" in s:
            print(
                f"docs {doc_len:>7s}: next (on) / first (off) = {s['next_on_over_first_off']:.3%}"
            )
    for c, s in summary.get("chat", {}).items():
        print(
            f"chat cache {c:3s}: turns {[round(t, 3) for t in s['turn_ttft_s']]}  "
            f"total {s['total_ttft_s']:.3f}s"
        )
    for c, s in summary.get("distinct", {}).items():
        if isinstance(s, dict):
            print(f"distinct cache {c:3s}: median TTFT {s['ttft_median_s']:.4f}s of {s['n']}")
    if "on_over_off" in summary.get("distinct", {}):
        print(f"distinct: on / off = {summary['distinct']['on_over_off']:.4f}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ppserve bench prefix",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--device", choices=DEVICES, default="cuda")
    add_model_args(p, shapes=("llama8b", "tiny"))
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated of {PARTS}")
    p.add_argument("--cache", default="off,on", help="prefix caching settings, one load each")
    p.add_argument("--docs", type=ints, default=[65536, 131072], help="document lengths")
    p.add_argument("--questions", type=int, default=4)
    p.add_argument("--question-len", type=int, default=256)
    p.add_argument("--chat-turns", type=int, default=8)
    p.add_argument("--chat-len", type=int, default=32768, help="about the last turn's prompt")
    p.add_argument("--chat-reply", type=int, default=64, help="tokens generated per turn")
    p.add_argument("--distinct", type=int, default=8)
    p.add_argument("--distinct-len", type=int, default=16384)
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--chunk-size", type=int, default=8192)
    p.add_argument("--block-size", type=int, default=engine_default("block_size"))
    p.add_argument("--linear", default="auto", help="linear backend")
    p.add_argument("--attention", default="auto", help="attention backend")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench_prefix.json")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = build_parser().parse_args(argv)
    parts = a.parts.split(",")
    caches = a.cache.split(",")
    if set(parts) - set(PARTS) or set(caches) - {"on", "off"} or a.chat_turns < 1:
        print(f"--parts takes {PARTS}, --cache on/off, --chat-turns >= 1", file=sys.stderr)
        return 2
    longest = max(max(a.docs) + a.question_len, a.chat_len + a.chat_reply, a.distinct_len)
    # Room for the longest request and a cached copy of another one as long.
    kv_blocks = 2 * math.ceil((longest + 64) / a.block_size) + 16

    import ray

    model_dir, load_format, model_cfg = write_model(a.model_shape, a.layers)
    owns_ray = start_local_ray(a.pp, a.device)
    rng = random.Random(a.seed)
    lo, hi = (1000, 120000) if a.model_shape == "llama8b" else (0, 256)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(lo, hi) for _ in range(n)]

    res: dict[str, Any] = {
        "command": "ppserve bench prefix " + " ".join(argv),
        "environment": environment(),
        "model": model_cfg,
        "model_shape": a.model_shape,
        "engines": {},
        "rows": [],
    }

    def write() -> None:
        res["summary"] = summarize(res["rows"])
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)

    for cache in caches:
        t0 = time.perf_counter()
        with BenchEngine(
            model=model_dir,
            load_format=load_format,
            pp_size=a.pp,
            device=a.device,
            dtype="bfloat16" if a.device == "cuda" else "float32",
            chunk_size=a.chunk_size,
            block_size=a.block_size,
            max_model_len=longest + 64,
            num_kv_blocks=kv_blocks,
            linear_backend=a.linear,
            attention_backend=a.attention,
            seed=a.seed,
            enable_prefix_caching=cache == "on",
        ) as engine:
            res["engines"][cache] = {
                k: v for k, v in engine.config.to_dict().items() if k != "model"
            }
            print(
                f"cache {cache}: loaded {a.model_shape} pp={a.pp} on {a.device} in "
                f"{time.perf_counter() - t0:.1f}s",
                flush=True,
            )
            for part in parts:
                # warm-up, not recorded; uncached questions repeat the first request's shapes
                warm = argparse.Namespace(**{**vars(a), "questions": 0}) if cache == "off" else a
                RUNNERS[part](engine, tokens, warm, cache, -1)
                for rep in range(a.reps):
                    rows = RUNNERS[part](engine, tokens, a, cache, rep)
                    for r in rows:
                        print(
                            f"{part:8s} cache {cache:3s} rep {rep} "
                            f"TTFT {[round(t, 3) for t in r['ttft_s']]} "
                            f"hits {r['prefix_hits']}",
                            flush=True,
                        )
                    res["rows"] += rows
                    write()  # a killed run keeps what it measured
    if owns_ray:
        ray.shutdown()
    write()
    _print(res["summary"])
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
