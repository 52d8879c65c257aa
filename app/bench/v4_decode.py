"""DeepSeek-V4 decode steps on one GPU at the stage: the deepseek-v4-flash bench shape's stage
(its leading layers, random weights), rows of one token at a context, the general eager path
(ForwardBatch + V4Plan.build, what every V4 decode ran before its graphs) against the decode
CUDA graphs (DecodeGraphs' replay of V4Plan.paged), per number of rows.

    python -m app.bench.v4_decode --rows 1,16,64,256,512 --context 512 \
        [--quantization fp8 --kv-cache-dtype fp8] [--linear auto] [--out FILE]

With ``--stacks`` the graphs' step is also run once without capture (``eager=True``: the same
buffers and kernels) under the profiler with Python stacks, and each launch of a kernel outside
Triton, the GEMMs and attention is counted by its torch op and the innermost stages/ frame that
called it (``launch_sources``): where a step's small launches come from, the fusions'
candidates.

Per rows: milliseconds per step (host and device: N steps back to back, synchronized at the
ends), tokens/s of the stage, and for one step of each path the profiled CUDA kernels' sum and
launch count (the step against its own kernels) with the top kernels. The cache is not
prefilled (its content does not change the time: every width is static in the graph). No
sampling: the stage's forward only, which is the step of PP=1 less the LM head.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from collections.abc import Callable
from typing import Any, cast

import torch

from app.bench.deepseek_breakdown import add_no_pdl_flag, profiled
from app.bench.target import kv_block_size, stage_args, v4_flash_bench_config
from stages.decode_graphs import DecodeGraphs
from stages.forward_batch import ForwardBatch
from stages.kernels import pdl, triton_moe_fp8
from stages.kernels.registry import fp8_backend_for, moe_backend_for, select_kernels
from stages.kv_cache import make_kv_cache
from stages.loader import build_stage_model
from stages.protocol import KV_CACHE_DTYPES, QUANTIZATIONS, Row


def _ms_per_step(step: Callable[[], object], steps: int, reps: int) -> float:
    """Median over reps of the mean wall time of `steps` back-to-back steps."""
    step()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / steps * 1e3)
    return round(statistics.median(times), 3)


def run(
    rows_list: list[int],
    context: int,
    fp8_weights: bool,
    kv_cache_dtype: str,
    steps: int,
    reps: int,
    linear: str = "auto",
    fp8_linear: str | None = None,
    shared_expert: str = "auto",
    stacks: bool = False,
    routed_experts: int | None = None,
) -> dict[str, Any]:
    config = v4_flash_bench_config()
    if routed_experts is not None:  # a few rows read only their picks: fewer fit a smaller GPU
        if routed_experts < config["num_experts_per_tok"]:
            raise ValueError(
                f"--routed-experts {routed_experts}: a token picks "
                f"{config['num_experts_per_tok']} of them"
            )
        config = dict(config, n_routed_experts=routed_experts)
    args = stage_args(config)
    if shared_expert != "auto":  # in the routed experts' stack, or a SwiGLU beside them
        fused = dataclasses.replace(
            args.family_args, shared_expert_in_stack=shared_expert == "stack"
        )
        args = dataclasses.replace(args, family_args=fused)
    layers = args.num_hidden_layers
    block = kv_block_size(config)
    kernels = select_kernels(
        "cuda",
        linear,
        moe_experts=moe_backend_for(linear),
        fp8_linear=(fp8_linear or fp8_backend_for(linear)) if fp8_weights else None,
    )
    model = build_stage_model(args, None, 0, layers, True, True, kernels, "bfloat16", "cuda")
    max_rows = max(rows_list)
    max_model_len = context + 64
    per_row = -(-max_model_len // block)
    num_blocks = max_rows * per_row + 1  # the last: the graphs' scratch block
    kv = make_kv_cache(
        args, range(layers), num_blocks, block, torch.bfloat16, "cuda", kv_cache_dtype
    )
    tables = {str(r): list(range(r * per_row, (r + 1) * per_row)) for r in range(max_rows)}
    graph_options: dict[str, Any] = {
        "model": cast(Any, model),
        "kv": kv,
        "num_slots": max_rows,
        "max_model_len": max_model_len,
        "scratch_slot": (num_blocks - 1) * block,
        "hidden_shape": args.family.hidden_shape(args),
        "dtype": torch.bfloat16,
        "device": torch.device("cuda"),
        "is_first": True,
        "max_rows": max_rows,
        "eager": False,
    }
    graphs = DecodeGraphs(**graph_options)
    graphs.update_tables([(r, 0, tuple(tables[str(r)])) for r in range(max_rows)])
    capture = graphs.capture()
    uncaptured = None
    if stacks:  # the same buffers and kernels, run without capture for the profiler's stacks
        uncaptured = DecodeGraphs(**{**graph_options, "eager": True})
        uncaptured.update_tables([(r, 0, tuple(tables[str(r)])) for r in range(max_rows)])
        uncaptured.capture()
    out: dict[str, Any] = {
        "shape": "deepseek-v4-flash",
        "layers": layers,
        "routed_experts": config["n_routed_experts"],
        "context": context,
        "fp8_weights": fp8_weights,
        "kv_cache_dtype": kv_cache_dtype,
        "kernels": kernels.names,
        "capture": capture,
        # launched with PDL, a kernel's profiled time includes its wait for the one before, so
        # kernels_ms over-counts (stages/kernels/pdl.py); the step time does not
        "pdl": pdl.ENABLED,
        "moe_swapped_below": triton_moe_fp8.SWAPPED_BELOW,
        "rows": {},
    }
    ids = torch.randint(3, args.vocab_size, (max_rows,), device="cuda")
    with torch.inference_mode():
        for n in rows_list:
            rows = tuple(
                Row(str(r), r, context, 1, None, sample=True, is_prefill=False) for r in range(n)
            )
            key = graphs.bucket_for(rows)
            if key is None:
                raise RuntimeError(f"no decode graph for {n} rows")
            general_rows = [(context, 1, tables[str(r)], True) for r in range(n)]

            def eager(n: int = n, general_rows: list[Any] = general_rows) -> object:
                batch = ForwardBatch.build(general_rows, block, "cuda", False)
                return model(ids[:n], batch, kv)

            def graphed(n: int = n, rows: tuple[Row, ...] = rows, key: Any = key) -> object:
                return graphs.run(key, rows, ids[:n], tables)

            result: dict[str, Any] = {"bucket": list(key)}
            for name, step in (("eager", eager), ("graph", graphed)):
                ms = _ms_per_step(step, steps, reps)
                prof = profiled(step)
                result[name] = {
                    "ms_per_step": ms,
                    "tok_per_s": round(n / ms * 1e3, 1),
                    "kernels_ms": prof["total_ms"],
                    "kernel_launches": prof["kernel_launches"],
                    "step_over_kernels": round(ms / max(prof["total_ms"], 1e-9), 2),
                    "groups_ms": prof["groups_ms"],
                    "top_kernels_ms": prof["top_kernels_ms"][:24],
                    # what the launches are: the fusions' candidates at few rows
                    "launches_by_group": prof["launches_by_group"],
                    "most_launched": prof["most_launched"],
                }
            if uncaptured is not None:
                plain = uncaptured

                def uncaptured_step(
                    n: int = n, rows: tuple[Row, ...] = rows, key: Any = key
                ) -> object:
                    return plain.run(key, rows, ids[:n], tables)

                result["launch_sources"] = launch_sources(uncaptured_step)
            out["rows"][str(n)] = result
            print(json.dumps({"rows": n, **{k: v for k, v in result.items()}})[:600], flush=True)
    return out


# kernels whose launches are not the question (each is one op's own kernel)
_OWN_KERNELS = ("triton", "gemm", "nvjet", "cublas", "flash", "mla", "sparse", "cutlass")


def launch_sources(
    step: Callable[[], object], top: int = 40, cuda: bool = True
) -> list[dict[str, Any]]:
    """One run of `step` under the profiler with Python stacks: launches of torch ops (not the
    Triton, GEMM and attention kernels) counted by (op, the innermost stages/ frame). cuda=False
    (a CPU step, the tests'): each op counted once, as it has no kernels."""
    from torch._C._profiler import _ExperimentalConfig
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    step()
    if cuda:
        torch.cuda.synchronize()
    # verbose: without it the events carry no Python stacks (torch 2.11-2.13), every frame ""
    config = _ExperimentalConfig(verbose=True)
    with profile(activities=activities, with_stack=True, experimental_config=config) as p:
        step()
        if cuda:
            torch.cuda.synchronize()
    counts: dict[tuple[str, str], int] = {}
    for evt in p.events():
        if not evt.name.startswith("aten::") or (cuda and not evt.kernels):
            continue
        if cuda and all(any(k in kern.name.lower() for k in _OWN_KERNELS) for kern in evt.kernels):
            continue
        frame = next((f for f in evt.stack if "stages/" in f), evt.stack[0] if evt.stack else "")
        key = (evt.name, frame.split("stages/")[-1])
        counts[key] = counts.get(key, 0) + (len(evt.kernels) if cuda else 1)
    ranked = sorted(counts.items(), key=lambda kv: -kv[1])[:top]
    return [{"launches": c, "op": op, "frame": frame} for (op, frame), c in ranked]


def main() -> None:
    p = argparse.ArgumentParser(prog="ppserve bench v4-decode", description=__doc__)
    p.add_argument("--rows", default="1,16,64,256,512")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--quantization", choices=QUANTIZATIONS, default="none")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto")
    p.add_argument("--steps", type=int, default=10, help="steps timed back to back")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--linear", default="auto", help="the engine's --linear (and FP8 linears')")
    p.add_argument(
        "--fp8-linear", default=None, help="the W8A8 linears' backend (default: --linear's)"
    )
    p.add_argument(
        "--shared-expert",
        choices=("auto", "stack", "beside"),
        default="auto",
        help="V4's shared expert in the routed experts' grouped kernel or a SwiGLU beside them",
    )
    p.add_argument(
        "--stacks", action="store_true", help="count the small launches by op and calling frame"
    )
    p.add_argument(
        "--moe-decode",
        choices=("swapped", "tiles"),
        default="swapped",
        help="a decode step's FP8 experts: weight rows as the MMA's wide side, or the grouped "
        "kernels' 64-row tiles",
    )
    p.add_argument(
        "--routed-experts",
        type=int,
        default=None,
        help="routed experts a layer (the shape's 256 by default): a one-row step reads its 6 "
        "picks and the shared expert whatever the count, and the bf16 stage with 128 fits 80 GB",
    )
    p.add_argument("--out", default=None)
    add_no_pdl_flag(p)
    a = p.parse_args()
    pdl.ENABLED = not a.no_pdl
    if a.moe_decode == "tiles":
        triton_moe_fp8.SWAPPED_BELOW = 0
    out = run(
        [int(x) for x in a.rows.split(",")],
        a.context,
        a.quantization == "fp8",
        a.kv_cache_dtype,
        a.steps,
        a.reps,
        a.linear,
        a.fp8_linear,
        a.shared_expert,
        a.stacks,
        a.routed_experts,
    )
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
