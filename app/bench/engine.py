"""`ppserve bench engine`: TTFT of lone long prompts per skip mode and posting policy, with the
no-contention bound, on a Llama-3-8B-shaped random model (docs/ARCHITECTURE.md#benchmarks).

One pipeline is loaded per (PP size, linear backend) and measured under every policy through
BenchEngine.set_policy, so the modes differ in nothing but the policy. The bound is the pipeline
schedule (flow shop) over per-stage chunk times from CUDA events of the `auto` run (no recv
waits mid-prompt there); efficiency = bound / TTFT.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from typing import Any

from app.bench.target import (
    LLAMA3_8B,
    BenchEngine,
    StageTiming,
    add_memory_flags,
    add_model_args,
    add_output_channel_arg,
    engine_default,
    environment,
    kv_block_size,
    kv_info,
    lone_prompt_chunk_sizes,
    memory_options,
    start_local_ray,
    write_model,
)

# mode name -> (skip_mode, output_post, linear backend override or None)
MODES = {
    "off-early": ("off", "early", None),
    "off-late": ("off", "late", None),
    "off-sm1": ("off", "early", "triton-persistent-sm1"),
    "sglang": ("sglang", "early", None),
    "auto": ("auto", "early", None),
}


def flow_shop_bound(times: list[list[float]]) -> float:
    """times[s][k]: stage s's compute of chunk k. Makespan with no waiting but data order."""
    stages, chunks = len(times), len(times[0])
    finish = [[0.0] * chunks for _ in range(stages)]
    for s in range(stages):
        for k in range(chunks):
            ready = max(finish[s - 1][k] if s else 0.0, finish[s][k - 1] if k else 0.0)
            finish[s][k] = ready + times[s][k]
    return finish[-1][-1]


def _stage_times(timings: list[StageTiming], pp: int, n_chunks: int) -> list[list[float]] | None:
    """[stage][chunk] seconds of a lone prompt's n_chunks chunks, or None when the run was not
    exactly n_chunks prefill microbatches + one decode step (max_tokens=2)."""
    by_mb: dict[int, dict[int, float]] = {}
    for stage, mb, sec in timings:
        by_mb.setdefault(mb, {})[stage] = sec
    mbs = sorted(by_mb)[:n_chunks]
    if len(by_mb) != n_chunks + 1 or any(len(by_mb[m]) < pp for m in mbs):
        return None
    return [[by_mb[m][s] for m in mbs] for s in range(pp)]


def parse_chunking(spec: str) -> tuple[str, float | None]:
    """`fixed`, `dynamic` (EngineConfig's default smooth) or `dynamic:S` -> (name, smooth or
    None)."""
    name, _, smooth = spec.partition(":")
    if name == "fixed" and not smooth:
        return spec, None
    if name == "dynamic":
        return spec, float(smooth) if smooth else engine_default("dynamic_chunk_smooth")
    raise ValueError(f"chunking must be fixed, dynamic or dynamic:SMOOTH, got {spec!r}")


def chunk_plan(prompt_len: int, chunk: int, smooth: float | None, m: dict[str, Any]) -> list[int]:
    """The chunk sizes the scheduler cuts a lone prompt into (its own pure rule), for the
    model config dict `m`."""
    return lone_prompt_chunk_sizes(prompt_len, chunk, smooth, m)


def run_config(
    engine: BenchEngine,
    pp: int,
    linear: str,
    prompt_len: int,
    chunk: int,
    modes: list[str],
    reps: int,
    chunking: str = "fixed",
    model: dict[str, Any] = LLAMA3_8B,
    seed: int = 0,
) -> list[dict[str, Any]]:
    from app.request import SamplingParams

    rng = random.Random(seed)
    vocab = model["vocab_size"]
    prompt = [rng.randrange(min(1000, vocab // 4), min(120000, vocab)) for _ in range(prompt_len)]
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    _, smooth = parse_chunking(chunking)
    chunks = chunk_plan(prompt_len, chunk, smooth, model)
    n_chunks = len(chunks)
    rows: list[dict[str, Any]] = []
    for mode in modes:
        skip, post, lin = MODES[mode]
        if lin and linear == "torch":
            continue  # the SMs-1 baseline only exists for the persistent GEMM
        kernels = engine.set_policy(
            skip_mode=skip,
            output_post=post,
            linear_backend=lin or linear,
            chunk_size=chunk,
            dynamic_chunking=smooth is not None,
            dynamic_chunk_smooth=smooth,
        )
        # set_policy rebuilt the attention plans of the new chunking (as a server does at
        # startup); two chunks also compile a Triton GEMM's kernels
        asyncio.run(engine.ttft(prompt[: min(prompt_len, 2 * chunk)], params))
        ttfts: list[float] = []
        bounds: list[float] = []
        stage_times = None
        comm0 = engine.comm()
        for _ in range(reps):
            engine.take_timings()
            ttfts.append(asyncio.run(engine.ttft(prompt, params)))
            times = _stage_times(engine.take_timings(), pp, n_chunks)
            if times:
                bounds.append(flow_shop_bound(times))
                stage_times = times
        comm1 = engine.comm()
        comm = {k: comm1[k] - comm0[k] for k in comm1}
        hit = comm["skipped"] / max(1, comm["skipped"] + comm["missed"])
        row = {
            "pp": pp,
            "tp": engine.config.tp_size,
            "linear": linear,
            "prompt_len": prompt_len,
            "chunk": chunk,
            "chunking": chunking,
            "chunks": chunks,
            "mode": mode,
            "kernels": kernels[0],
            "ttft_s": ttfts,
            "ttft_median_s": statistics.median(ttfts),
            "comm": comm,
            "skip_hit_ratio": hit,
            "bound_own_s": statistics.median(bounds) if bounds else None,
            "stage_times_s": stage_times,
        }  # [stage][chunk], the last run's, CUDA events
        rows.append(row)
        print(
            f"pp={pp} {linear:18s} {prompt_len:>7d}/{chunk:<5d} {chunking:12s} {mode:10s} "
            f"TTFT {row['ttft_median_s']:.3f}s  runs {[round(t, 3) for t in ttfts]}  "
            f"comm {comm}",
            flush=True,
        )
    auto = [r for r in rows if r["mode"] == "auto" and r["bound_own_s"]]
    bound = auto[0]["bound_own_s"] if auto else None
    for r in rows:
        r["bound_s"] = bound
        r["efficiency"] = bound / r["ttft_median_s"] if bound else None
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="ppserve bench engine",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel GPUs per stage")
    p.add_argument("--device", default="cuda")
    p.add_argument(
        "--linear",
        default="torch,triton-persistent",
        help="comma-separated linear backends, one pipeline load each",
    )
    p.add_argument("--runs", default="32768:4096", help="comma-separated prompt_len:chunk pairs")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument(
        "--chunking",
        default="fixed",
        help="comma-separated: fixed, dynamic (the engine's default smooth) or dynamic:SMOOTH",
    )
    p.add_argument("--reps", type=int, default=3)
    add_model_args(p)
    p.add_argument("--max-inflight", type=int, default=None)
    p.add_argument("--attention", default="auto", help="attention backend (auto, torch)")
    add_output_channel_arg(p)
    add_memory_flags(p)
    p.add_argument("--out", default="bench_engine.json")
    a = p.parse_args(argv)

    import ray

    model_dir, load_format, model = write_model(a.model_shape, a.layers)
    runs = [tuple(int(x) for x in r.split(":")) for r in a.runs.split(",")]
    longest = max(n for n, _ in runs)
    block = kv_block_size(model)
    owns_ray = start_local_ray(a.pp * a.tp, a.device)
    rows = []
    for linear in a.linear.split(","):
        t0 = time.perf_counter()
        with BenchEngine(
            model=model_dir,
            load_format=load_format,
            pp_size=a.pp,
            tp_size=a.tp,
            device=a.device,
            dtype="bfloat16" if a.device == "cuda" else "float32",
            chunk_size=runs[0][1],
            linear_backend=linear,
            attention_backend=a.attention,
            max_model_len=longest + 64,
            max_inflight=a.max_inflight,
            output_channel=a.output_channel,
            **memory_options(a, (longest + 256) // block + 8),
        ) as engine:
            kv = kv_info(engine)
            print(
                f"loaded pp={a.pp} linear={linear} in {time.perf_counter() - t0:.1f}s; KV {kv}",
                flush=True,
            )
            for prompt_len, chunk in runs:
                for chunking in a.chunking.split(","):
                    config_rows = run_config(
                        engine,
                        a.pp,
                        linear,
                        prompt_len,
                        chunk,
                        a.modes.split(","),
                        a.reps,
                        chunking,
                        model,
                    )
                    rows += [
                        dict(
                            r,
                            quantization=a.quantization,
                            kv_cache_dtype=a.kv_cache_dtype,
                            fp8_prefill_attention=a.fp8_prefill_attention,
                            mxfp4_experts=a.mxfp4_experts,
                            **kv,
                        )
                        for r in config_rows
                    ]
                    # after every config: a killed run keeps what it measured
                    _write(a, argv, rows, model)
    if owns_ray:
        ray.shutdown()
    print(f"wrote {a.out}")
    return 0


def _write(
    a: argparse.Namespace, argv: list[str] | None, rows: list[dict[str, Any]], model: dict[str, Any]
) -> None:
    out = {
        "command": "python -m app.bench " + " ".join(argv or sys.argv[1:]),
        "environment": environment(),
        "model": model,
        "results": rows,
    }
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
