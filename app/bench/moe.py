"""The grouped MoE GEMMs on DeepSeek / Qwen3-MoE shapes against cuBLAS running the same FLOPs as
two dense GEMMs, and their contention under the one-CTA pending-recv stand-in
(docs/ARCHITECTURE.md#why-the-output-channel-matters).

    python -m app.bench.moe --tune --out docs/bench/moe_kernels.json

FLOPs of one call: 6 * tokens * top-k * hidden * expert width (gate/up, then down).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from app.bench.standin import PendingRecvStandin, median_ms
from stages.kernels import triton_moe
from stages.kernels.moe_routing import route_and_gather
from stages.kernels.moe_tuning import DEFAULT, MoeConfig, TileConfig, pick_moe_config
from stages.kernels.triton_gemm import num_sms
from stages.kernels.triton_moe_combine import combine

# name -> (experts, top-k, hidden, expert width)
SHAPES = {
    "deepseek-v2-lite": (64, 6, 2048, 1408),
    "deepseek-v3": (256, 8, 7168, 2048),
    "qwen3-moe": (128, 8, 2048, 768),
    "deepseek-v4": (256, 6, 4096, 2048),
}
# (block_n, block_k, group_m, stages, warps, flatten, warp_specialize); the first of each list
# was the best of the previous sweep
GATE_CANDIDATES = [
    TileConfig(128, 64, 8, 3, 8),
    TileConfig(128, 64, 8, 3, 8, True),
    TileConfig(128, 64, 8, 3, 8, False, True),
]
DOWN_CANDIDATES = [
    TileConfig(256, 64, 8, 3, 8),
    TileConfig(256, 64, 8, 3, 8, True),
    TileConfig(256, 64, 8, 3, 8, False, True),
]
SMALL_M: list[MoeConfig] = []


def expert_loads(ids: torch.Tensor, experts: int) -> dict[str, float]:
    """How evenly one routing spreads a chunk's rows over the routed experts (ids [T, k]; a
    shared slot's column past them is left out): experts touched, the busiest one's rows, the
    mean and the coefficient of variation over all of them. The grouped GEMM reads each touched
    expert's weights once, and a skewed load favours taller tiles."""
    counts = torch.bincount(ids.flatten().long(), minlength=experts)[:experts].double()
    mean = counts.mean()
    return {
        "touched": int((counts > 0).sum()),
        "max_rows": int(counts.max()),
        "mean_rows": round(float(mean), 2),
        "cv": round(float(counts.std(unbiased=False) / mean), 3) if mean > 0 else 0.0,
    }


def timed(
    fn: Callable[[], object],
    standin: PendingRecvStandin | None = None,
    reps: int = 15,
    inner: int = 1,
) -> float:
    """Median ms per call (app.bench.standin.median_ms); with the stand-in, a 400 ms spin."""
    pre = None if standin is None else (lambda: standin.post(400))
    return float(median_ms(fn, pre, reps, inner)["ms"])


def inputs(
    tokens: int, experts: int, k: int, hidden: int, inter: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g, device="cuda").bfloat16()
    gate_up = (
        torch.randn(experts, 2 * inter, hidden, generator=g, device="cuda") * hidden**-0.5
    ).bfloat16()
    down = (
        torch.randn(experts, hidden, inter, generator=g, device="cuda") * inter**-0.5
    ).bfloat16()
    weights, ids = torch.randn(tokens, experts, generator=g, device="cuda").softmax(-1).topk(k)
    return x, gate_up, down, ids, weights


def load_module(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location("before_moe", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"--before {path!r} is not a loadable Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def bench_case(
    name: str, tokens: int, tune: bool, before: ModuleType | None, standin: PendingRecvStandin
) -> dict[str, Any]:
    experts, k, hidden, inter = SHAPES[name]
    x, gate_up, down, ids, weights = inputs(tokens, experts, k, hidden, inter)
    flops = 6 * tokens * k * hidden * inter

    def tflops(ms: float) -> float:
        return round(flops / ms / 1e9, 1)

    a1 = torch.randn(tokens * k, hidden, device="cuda").bfloat16()
    w1 = torch.randn(2 * inter, hidden, device="cuda").bfloat16()
    a2 = torch.randn(tokens * k, inter, device="cuda").bfloat16()
    w2 = torch.randn(hidden, inter, device="cuda").bfloat16()

    def dense() -> tuple[torch.Tensor, torch.Tensor]:
        return a1 @ w1.T, a2 @ w2.T

    row: dict[str, Any] = {
        "shape": name,
        "tokens": tokens,
        "experts": experts,
        "topk": k,
        "hidden": hidden,
        "inter": inter,
        "gflop": round(flops / 1e9, 1),
    }
    row["cublas_dense_ms"] = timed(dense, inner=3)
    row["cublas_dense_tflops"] = tflops(row["cublas_dense_ms"])
    sms = num_sms("cuda")

    def run(cfg: MoeConfig, grid: int = sms) -> Callable[[], torch.Tensor]:
        return lambda: triton_moe.run_moe(x, gate_up, down, ids, weights, grid, cfg)

    if before is not None:
        before_moe: Callable[..., torch.Tensor] = before.moe_experts
        ms = timed(lambda: before_moe(x, gate_up, down, ids, weights), reps=5, inner=3)
        row["before_ms"], row["before_tflops"] = ms, tflops(ms)
    trials: list[dict[str, Any]] = []

    def trial(cfg: MoeConfig) -> float:
        try:
            ms = timed(run(cfg), reps=7, inner=3)
        except Exception as e:  # a config over the shared-memory budget, say
            trials.append({"config": cfg.as_dict(), "error": repr(e)[:200]})
            return float("inf")
        trials.append({"config": cfg.as_dict(), "ms": ms, "tflops": tflops(ms)})
        return ms

    if tune:
        best, best_ms = DEFAULT, float("inf")
        first_down = DOWN_CANDIDATES[0]
        gate_best = min(GATE_CANDIDATES, key=lambda g: trial(MoeConfig(128, g, first_down)))
        for d in DOWN_CANDIDATES:
            ms = trial(MoeConfig(128, gate_best, d))
            if ms < best_ms:
                best, best_ms = MoeConfig(128, gate_best, d), ms
        for cfg in SMALL_M:
            ms = trial(cfg)
            if ms < best_ms:
                best, best_ms = cfg, ms
        row["trials"] = trials
    else:
        best = pick_moe_config(tokens, k, experts, hidden, inter)
    row["config"] = best.as_dict()
    for label, grid in (("sms", sms), ("sms_minus_1", sms - 1)):
        alone = timed(run(best, grid), inner=3)
        busy = timed(run(best, grid), standin, inner=3)
        row[f"{label}_ms"], row[f"{label}_tflops"] = alone, tflops(alone)
        row[f"{label}_standin_ms"], row[f"{label}_standin_x"] = busy, round(busy / alone, 3)
    dense_busy = timed(dense, standin, inner=3)
    row["phases_ms"] = phases(x, gate_up, down, ids, weights, sms, best)
    weight_bytes = 3 * experts * hidden * inter * 2
    # the chip's dense bf16 rate (cuBLAS above) and HBM's 4.8 TB/s: whichever binds
    row["roofline_ms"] = round(max(row["cublas_dense_ms"], weight_bytes / 4.8e9), 3)
    row["cublas_dense_standin_x"] = round(dense_busy / row["cublas_dense_ms"], 3)
    row["vs_cublas"] = round(row["cublas_dense_ms"] / row["sms_ms"], 3)
    print(json.dumps({k_: v for k_, v in row.items() if k_ != "trials"}), flush=True)
    return row


def phases(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    grid: int,
    cfg: MoeConfig,
) -> dict[str, float]:
    """Each launch of one call timed alone (ms): routing + row copy, gate/up, down, the sum
    (triton_moe_combine)."""
    t, k = ids.shape
    r, a = route_and_gather(x, ids, weights, down.shape[0], cfg.block_m)
    h = triton_moe.gate_up_silu(a, gate_up, r, grid, cfg.gate)
    y = triton_moe.down_scatter(h, down, r, t * k, grid, cfg.down)
    steps: dict[str, Callable[[], object]] = {
        "route_and_gather": lambda: route_and_gather(x, ids, weights, down.shape[0], cfg.block_m),
        "gate_up_silu": lambda: triton_moe.gate_up_silu(a, gate_up, r, grid, cfg.gate),
        "down_scatter": lambda: triton_moe.down_scatter(h, down, r, t * k, grid, cfg.down),
        "sum_over_k": lambda: combine(y, ids, x.dtype),
    }
    return {name: round(timed(fn, inner=3), 4) for name, fn in steps.items()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--tokens", default="4096,8192")
    p.add_argument("--tune", action="store_true")
    p.add_argument("--before", default="", help="path of the previous triton_moe.py to compare")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    before = load_module(a.before) if a.before else None
    standin = PendingRecvStandin()
    import triton

    env = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(),
        "triton": triton.__version__,
    }
    rows: list[dict[str, Any]] = []
    for s in a.shapes.split(","):
        for t in a.tokens.split(","):
            rows.append(bench_case(s, int(t), a.tune, before, standin))
            with open(a.out, "w") as f:  # after each case: a run cut short keeps the rest
                json.dump({"env": env, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
