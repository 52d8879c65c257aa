"""`ppserve bench load`: the skip decision under load (docs/ARCHITECTURE.md#the-skip-rule).

mixed  — M short-prompt requests decoding (ignore_eos, long outputs, all admitted in one
         microbatch so they decode in lockstep), then N long prompts arriving together. TTFT
         p50 / p99 of the long prompts (Engine.stream, time to the first delta) per skip mode.
decode — C concurrent short prompts with --decode-tokens outputs each, streamed: output tokens/s
         of the whole run (the prefill included), and of the decode in lockstep (every request
         past its first token, none finished), with the inter-token latency p50 / p99. Queued
         at once, they decode in lockstep: one microbatch in flight at a time, whatever the PP
         size; --decode-tokens must outlast the prompts' prefill for a lockstep window.
         --decode-concurrency 1,16,64 measures each C on the one engine (the JSON's "decode" is
         then a list of parts, one per C).

Both report the sent / skipped / missed / orphaned deltas of engine.stats()["pp_output_comm"]
and the skip-hit ratio; medians of --reps runs. One Engine (one pipeline load) is measured under
every mode with BenchEngine.set_policy between runs, rep-major (modes interleaved within each rep).

Where `auto` and `sglang` differ: a microbatch holding a decode row whose token is needed is sent
by both rules, so the difference lives in the decode-free microbatches (with PP=S, S-1 of every S
while the decodes run in lockstep) that hold chunks of two or more long prompts: `sglang` sends
them (missed), `auto` skips them. The default token budget is therefore 2 x --chunk-size, which
puts two long prompts' chunks in every such microbatch (with a budget of one chunk, one long prompt
fills each and both rules skip it).
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

from app.bench.stream_timing import percentile, steady_decode, stream_shape
from app.bench.target import (
    BenchEngine,
    add_memory_flags,
    add_model_args,
    add_output_channel_arg,
    environment,
    kv_block_size,
    kv_info,
    memory_options,
    start_local_ray,
    write_model,
)
from app.request import Prompt, SamplingParams
from stages.protocol import DEVICES

COMM_KEYS = ("sent", "skipped", "missed", "orphaned")
LONG_MAX_TOKENS = 2  # as the lone-prompt bench: the first token is needed at stage 0


def _comm_delta(c0: dict[str, int], c1: dict[str, int]) -> tuple[dict[str, int], float]:
    d = {k: c1.get(k, 0) - c0.get(k, 0) for k in COMM_KEYS}
    return d, d["skipped"] / max(1, d["skipped"] + d["missed"])


def _model(a: argparse.Namespace) -> tuple[str | None, str, dict[str, Any]]:
    """(model dir or None, load_format, config dict) for --model-shape / --layers."""
    return write_model(a.model_shape, a.layers)


async def _mixed_once(
    engine: BenchEngine, longs: list[Prompt], shorts: list[Prompt], dec_tokens: int
) -> dict[str, Any]:
    from app.request import SamplingParams

    c0 = engine.wait_idle()["pp_output_comm"]
    sp_dec = SamplingParams(max_tokens=dec_tokens, temperature=0.0, ignore_eos=True)
    sp_long = SamplingParams(max_tokens=LONG_MAX_TOKENS, temperature=0.0, ignore_eos=True)
    # One generate call queues every decode request before the coordinator schedules again, so
    # they are admitted into one microbatch and decode in lockstep.
    dec = shorts and asyncio.ensure_future(asyncio.to_thread(engine.generate, shorts, sp_dec))
    while dec:  # until they decode: prefill microbatch + >= 2 decode microbatches
        s = await asyncio.to_thread(engine.stats)
        if (
            s["num_running"] >= len(shorts)
            and not s["num_waiting"]
            and s["pp_output_comm"]["sent"] >= c0["sent"] + 3
        ):
            break
        if dec.done():
            raise RuntimeError("the decoding requests ended before the long prompts arrived")
        await asyncio.sleep(0.002)
    t0 = time.perf_counter()
    ttfts = await asyncio.gather(*[engine.ttft(p, sp_long) for p in longs])
    long_s = time.perf_counter() - t0
    outlasted = not dec or not dec.done()
    if dec:
        await dec
    comm, hit = _comm_delta(c0, engine.wait_idle()["pp_output_comm"])
    return {
        "ttft_s": ttfts,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "long_phase_s": long_s,
        "decodes_outlasted": outlasted,
        "comm": comm,
        "skip_hit_ratio": hit,
    }


async def _streamed(
    engine: BenchEngine, prompts: list[Prompt], params: SamplingParams
) -> list[list[float]]:
    return await asyncio.gather(*[engine.token_times(p, params) for p in prompts])


def _decode_once(engine: BenchEngine, prompts: list[Prompt], n_tokens: int) -> dict[str, Any]:
    c0 = engine.wait_idle()["pp_output_comm"]
    engine.take_timings()
    params = SamplingParams(max_tokens=n_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    times = asyncio.run(_streamed(engine, prompts, params))
    wall = time.perf_counter() - t0
    tokens = sum(len(t) for t in times)
    comm, hit = _comm_delta(c0, engine.wait_idle()["pp_output_comm"])
    # Per microbatch: stage 0's forward (CUDA events; the median is a decode step's, the
    # prefill is one microbatch of the run) and the wall shared among the microbatches.
    forwards = [sec for stage, _mb, sec in engine.take_timings() if stage == 0]
    return {
        "wall_s": wall,
        "output_tokens": tokens,
        "tokens_per_s": tokens / wall,
        "comm": comm,
        "skip_hit_ratio": hit,
        "microbatches": len(forwards),
        "stage_forward_s": statistics.median(forwards) if forwards else None,
        "wall_per_microbatch_s": wall / max(1, len(forwards)),
        **steady_decode(times),
        "stream": stream_shape(times, t0),
    }


def summarize(runs: list[dict[str, Any]], keys: tuple[str, ...]) -> dict[str, Any]:
    """Medians over reps of the numbers in `keys` and of each comm counter."""
    out: dict[str, Any] = {"reps": len(runs)}
    for k in keys + ("skip_hit_ratio",):
        values = [r[k] for r in runs if r[k] is not None]
        out[k] = statistics.median(values) if values else None
    out["comm"] = {k: statistics.median(r["comm"][k] for r in runs) for k in COMM_KEYS}
    return out


def _sweep(
    engine: BenchEngine,
    part: dict[str, Any],
    write: Callable[[], None],
    keys: tuple[str, ...],
    run: Callable[[], dict[str, Any]],
    line: Callable[[dict[str, Any]], str],
) -> None:
    """Rep-major: every mode once per rep, set_policy on an idle pipeline before each run."""
    for rep in range(part["reps"]):
        for mode in part["modes"]:
            engine.wait_idle()
            engine.set_policy(skip_mode=mode)
            r = dict(mode=mode, rep=rep, **run())
            part["runs"].append(r)
            print(f"{part['name']:6s} rep {rep} {mode:7s} {line(r)}", flush=True)
            write()
    part["summary"] = {
        mode: summarize([r for r in part["runs"] if r["mode"] == mode], keys)
        for mode in part["modes"]
    }
    write()


def _comm_str(comm: dict[str, int], hit: float) -> str:
    return " ".join(f"{comm[k]:>8g}" for k in COMM_KEYS) + f" {hit:>6.3f}"


def decode_parts(res: dict[str, Any]) -> list[dict[str, Any]]:
    """The decode parts of a result: one per concurrency (a file of one C holds a dict)."""
    d = res.get("decode")
    return [] if d is None else d if isinstance(d, list) else [d]


def _concurrencies(text: str) -> list[int]:
    values = [int(x) for x in text.split(",") if x.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"concurrencies must be positive integers: {text!r}")
    return values


def _print_tables(res: dict[str, Any]) -> None:
    head = " ".join(f"{k:>8s}" for k in COMM_KEYS) + "    hit"
    if res.get("mixed", {}).get("summary"):
        m = res["mixed"]
        print(
            f"\nmixed load: {m['num_long']} x {m['long_len']} tokens arriving together + "
            f"{m['num_decode']} decoding; medians of {m['reps']}"
        )
        print(f"{'mode':8s} {'TTFT p50':>9s} {'TTFT p99':>9s} " + head)
        for mode, s in m["summary"].items():
            print(
                f"{mode:8s} {s['ttft_p50_s']:9.3f} {s['ttft_p99_s']:9.3f} "
                + _comm_str(s["comm"], s["skip_hit_ratio"])
            )
    for d in decode_parts(res):
        if not d.get("summary"):
            continue
        print(
            f"\ndecode throughput: {d['concurrency']} concurrent x {d['decode_tokens']} "
            f"tokens; medians of {d['reps']}"
        )
        print(f"{'mode':8s} {'tok/s':>9s} {'wall s':>9s} " + head)
        for mode, s in d["summary"].items():
            print(
                f"{mode:8s} {s['tokens_per_s']:9.1f} {s['wall_s']:9.3f} "
                + _comm_str(s["comm"], s["skip_hit_ratio"])
            )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ppserve bench load",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel GPUs per stage")
    p.add_argument("--device", choices=DEVICES, default="cuda")
    add_model_args(p)
    p.add_argument("--parts", default="mixed,decode", help="mixed, decode or both")
    p.add_argument("--long-len", type=int, default=32768)
    p.add_argument("--num-long", type=int, default=4)
    p.add_argument("--num-decode", type=int, default=32, help="decoding requests (mixed)")
    p.add_argument("--short-len", type=int, default=16, help="prompt of the short requests")
    p.add_argument(
        "--decode-concurrency",
        type=_concurrencies,
        default=[64],
        help="requests (decode part); a comma list measures each on one engine",
    )
    p.add_argument("--decode-tokens", type=int, default=256, help="outputs (decode part)")
    p.add_argument("--modes", default="sglang,auto", help="skip modes of the mixed load")
    p.add_argument("--decode-modes", default="off,auto", help="skip modes of the decode part")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--chunk-size", type=int, default=4096)
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="token budget per microbatch (default 2 x --chunk-size)",
    )
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--stream-interval", type=int, default=1, help="tokens a streamed delta carries")
    p.add_argument("--linear", default="auto", help="linear backend")
    p.add_argument("--attention", default="auto", help="attention backend")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--enforce-eager", action="store_true", help="decode-only microbatches without CUDA graphs"
    )
    p.add_argument(
        "--run-ahead",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="default: the engine's (on with CUDA)",
    )
    add_output_channel_arg(p)
    p.add_argument(
        "--reference",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="time the decode step as a plain graph replay first (decode part, CUDA)",
    )
    add_memory_flags(p)
    p.add_argument("--out", default="bench_load.json")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = build_parser().parse_args(argv)
    parts = a.parts.split(",")
    budget = a.max_num_batched_tokens or 2 * a.chunk_size
    need_seqs = max(
        a.num_long + a.num_decode if "mixed" in parts else 1,
        max(a.decode_concurrency) if "decode" in parts else 1,
    )
    seqs = a.max_num_seqs or need_seqs
    if seqs < need_seqs:
        print(
            f"--max-num-seqs must be >= {need_seqs} (num_long + num_decode, and "
            f"--decode-concurrency)",
            file=sys.stderr,
        )
        return 2
    if "mixed" in parts and a.num_decode * a.short_len > budget:
        print(
            "warning: the decoding requests' prompts exceed one microbatch's budget; they "
            "may not decode in lockstep",
            file=sys.stderr,
        )
    # Decode tokens of the mixed load: enough to outlast the long prompts. In steady state one
    # decode microbatch runs per `pp` microbatches, which carry >= (pp-1)*budget + (budget-M)
    # long-prompt tokens; twice that many steps plus a margin for the arrivals.
    per_step = max(1, (a.pp - 1) * budget + max(0, budget - a.num_decode))
    dec_mixed = 2 * math.ceil(a.num_long * a.long_len / per_step) + 32

    model_dir, load_format, model_cfg = _model(a)
    block = kv_block_size(model_cfg)

    def blocks(n_req: int, n_tok: int) -> int:
        return n_req * math.ceil(n_tok / block)

    kv_blocks = 16 + max(
        blocks(a.num_long, a.long_len + LONG_MAX_TOKENS)
        + blocks(a.num_decode, a.short_len + dec_mixed),
        blocks(max(a.decode_concurrency), a.short_len + a.decode_tokens),
    )
    max_len = max(a.long_len + LONG_MAX_TOKENS, a.short_len + max(dec_mixed, a.decode_tokens))

    import ray

    owns_ray = start_local_ray(a.pp * a.tp, a.device)
    options = dict(
        model=model_dir,
        load_format=load_format,
        pp_size=a.pp,
        tp_size=a.tp,
        device=a.device,
        dtype="bfloat16" if a.device == "cuda" else "float32",
        chunk_size=a.chunk_size,
        max_num_batched_tokens=budget,
        max_num_seqs=seqs,
        max_model_len=max_len + 64,
        block_size=block,
        linear_backend=a.linear,
        attention_backend=a.attention,
        seed=a.seed,
        enforce_eager=a.enforce_eager,
        run_ahead=a.run_ahead,
        output_channel=a.output_channel,
        stream_interval=a.stream_interval,
        **memory_options(a, kv_blocks),
    )
    rng = random.Random(a.seed)
    lo, hi = (1000, model_cfg["vocab_size"] - 1000) if a.model_shape != "tiny" else (0, 256)

    def prompts(n: int, length: int) -> list[Prompt]:
        return [[rng.randrange(lo, hi) for _ in range(length)] for _ in range(n)]

    longs, shorts = prompts(a.num_long, a.long_len), prompts(a.num_decode, a.short_len)
    conc = prompts(max(a.decode_concurrency), a.short_len)
    res: dict[str, Any] = {
        "command": "ppserve bench load " + " ".join(argv),
        "environment": environment(),
        "model": model_cfg,
        "model_shape": a.model_shape,
        "pp": a.pp,
        "tp": a.tp,
    }
    if "mixed" in parts:
        res["mixed"] = {
            "name": "mixed",
            "num_long": a.num_long,
            "long_len": a.long_len,
            "num_decode": a.num_decode,
            "short_len": a.short_len,
            "decode_max_tokens": dec_mixed,
            "long_max_tokens": LONG_MAX_TOKENS,
            "modes": a.modes.split(","),
            "reps": a.reps,
            "runs": [],
        }
    if "decode" in parts:
        sweep = [
            {
                "name": "decode" if len(a.decode_concurrency) == 1 else f"dec{c}",
                "concurrency": c,
                "short_len": a.short_len,
                "decode_tokens": a.decode_tokens,
                "modes": a.decode_modes.split(","),
                "reps": a.reps,
                "runs": [],
            }
            for c in a.decode_concurrency
        ]
        res["decode"] = sweep[0] if len(sweep) == 1 else sweep

    def write() -> None:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)

    llama_shaped = "intermediate_size" in model_cfg
    if "decode" in parts and a.device == "cuda" and a.reference and llama_shaped:
        # Before the engine takes the GPU: the same shape's decode step as a plain graph replay
        # (a Llama-shaped loop with the config's dense MLP: none for DeepSeek-V4).
        from app.bench.decode_reference import graph_decode_step_s

        for d in decode_parts(res):
            d["reference"] = graph_decode_step_s(
                model_cfg, d["concurrency"], a.short_len + a.decode_tokens // 2
            )
            print(f"decode reference {d['concurrency']}: {d['reference']}", flush=True)
    t_load = time.perf_counter()
    with BenchEngine(**options) as engine:
        res["engine"] = {k: v for k, v in engine.config.to_dict().items() if k != "model"}
        res["engine"].update(kv_info(engine))
        print(
            f"loaded {a.model_shape} pp={a.pp} on {a.device} in "
            f"{time.perf_counter() - t_load:.1f}s; budget {budget}, chunk {a.chunk_size}; "
            f"KV {kv_info(engine)}",
            flush=True,
        )
        if "mixed" in parts:
            warm = [p[: min(a.long_len, 2 * a.chunk_size)] for p in longs]
            asyncio.run(_mixed_once(engine, warm, shorts, dec_mixed))  # warm-up, not counted
            _sweep(
                engine,
                res["mixed"],
                write,
                ("ttft_p50_s", "ttft_p99_s", "long_phase_s"),
                lambda: asyncio.run(_mixed_once(engine, longs, shorts, dec_mixed)),
                lambda r: (
                    f"TTFT p50 {r['ttft_p50_s']:.3f}s p99 {r['ttft_p99_s']:.3f}s "
                    f"comm {r['comm']} hit {r['skip_hit_ratio']:.3f}"
                    + ("" if r["decodes_outlasted"] else " (decodes ended early)")
                ),
            )
        for d in decode_parts(res):
            rows = conc[: d["concurrency"]]
            _decode_once(engine, rows, min(4, a.decode_tokens))  # warm-up
            _sweep(
                engine,
                d,
                write,
                (
                    "tokens_per_s",
                    "wall_s",
                    "stage_forward_s",
                    "wall_per_microbatch_s",
                    "steady_tokens_per_s",
                    "itl_p50_ms",
                    "itl_p99_ms",
                ),
                lambda: _decode_once(engine, rows, a.decode_tokens),
                lambda r: (
                    f"steady {r['steady_tokens_per_s'] or 0:.1f} tok/s, ITL p50 "
                    f"{r['itl_p50_ms'] or 0:.2f} ms; {r['tokens_per_s']:.1f} tok/s "
                    f"({r['output_tokens']} in "
                    f"{r['wall_s']:.3f}s) forward {r['stage_forward_s']} wall/mb "
                    f"{r['wall_per_microbatch_s']:.5f} comm {r['comm']}"
                ),
            )
            ref = d.get("reference")
            for s in d["summary"].values():
                if ref and s["stage_forward_s"]:
                    s["forward_over_reference"] = s["stage_forward_s"] / ref["graph_step_s"]
                if s["stage_forward_s"]:
                    s["wall_over_forward"] = s["wall_per_microbatch_s"] / s["stage_forward_s"]
            write()
    if owns_ray:
        ray.shutdown()
    _print_tables(res)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
