"""Per-kernel breakdown (torch profiler, CUDA time) of one DeepSeek prefill chunk and one decode
step on a stage of a few layers with random weights (the first layer dense, the rest MoE).

    python -m app.bench.deepseek_breakdown --out docs/bench/deepseek_breakdown.json

Prefill: the last chunk of a prompt in fixed chunks (the earlier ones fill the latent cache).
Decode: rows of one token at a given context length (the cache's content does not matter for
the time). Kernels are grouped by name into the ops of a layer.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from app.bench.target import shape_config
from stages.forward_batch import ForwardBatch
from stages.kernels.registry import select_kernels
from stages.kv_cache import make_kv_cache
from stages.loader import build_stage_model
from stages.model_config import ModelArgs

BLOCK = 64
# first matching substring of a kernel's name -> the op it belongs to
GROUPS = [
    ("_gate_up_silu", "moe gate/up"),
    ("_down_scatter", "moe down"),
    ("_scatter", "moe routing"),
    ("_count", "moe routing"),
    ("_plan", "moe routing"),
    ("rows_kernel", "indexer scores"),
    ("topk", "top-k"),
    ("radix", "top-k"),
    ("sort", "sort"),
    ("cudnn", "attention"),
    ("fmha", "attention"),
    ("flash", "attention"),
    ("_gemm_tma", "gemm (Triton)"),
    ("_gemm_ptr", "gemm (Triton)"),
    ("sm90_xmma", "gemm (cuBLAS)"),
    ("nvjet", "gemm (cuBLAS)"),
    ("gemm", "gemm (cuBLAS)"),
]


def group_of(name: str) -> str:
    lowered = name.lower()
    for key, group in GROUPS:
        if key.lower() in lowered:
            return group
    return "other"


def profiled(fn) -> dict:
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels: dict[str, float] = defaultdict(float)
    for evt in prof.key_averages():
        us = getattr(evt, "device_time_total", 0.0) or getattr(evt, "cuda_time_total", 0.0)
        if us and evt.key and not evt.key.startswith("cuda"):
            kernels[evt.key] += us
    groups: dict[str, float] = defaultdict(float)
    for name, us in kernels.items():
        groups[group_of(name)] += us
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:25]
    return {
        "total_ms": round(sum(kernels.values()) / 1e3, 3),
        "groups_ms": {
            g: round(us / 1e3, 3) for g, us in sorted(groups.items(), key=lambda x: -x[1])
        },
        "top_kernels_ms": [(name[:120], round(us / 1e3, 3)) for name, us in top],
    }


def run(shape: str, layers: int, prompt: int, chunk: int, decode_rows: int, decode_ctx: int):
    args = ModelArgs.from_hf_dict(dict(shape_config(shape), num_hidden_layers=layers))
    kernels = select_kernels("cuda")
    model = build_stage_model(args, None, 0, layers, True, True, kernels, "bfloat16", "cuda")
    blocks_prompt = -(-prompt // BLOCK)
    blocks_decode = decode_rows * -(-(decode_ctx + 1) // BLOCK)
    kv = make_kv_cache(
        args, layers, blocks_prompt + blocks_decode + 1, BLOCK, torch.bfloat16, "cuda"
    )
    table = list(range(blocks_prompt))
    tokens = torch.randint(0, args.vocab_size, (prompt,), device="cuda")
    with torch.inference_mode():
        for start in range(0, prompt - chunk, chunk):
            batch = ForwardBatch.build([(start, chunk, table, False)], BLOCK, "cuda")
            model(tokens[start : start + chunk], batch, kv)
        last = ForwardBatch.build([(prompt - chunk, chunk, table, True)], BLOCK, "cuda")
        out = {
            "shape": shape,
            "layers": layers,
            "kernels": kernels.names,
            "prefill": {
                "prompt": prompt,
                "chunk": chunk,
                **profiled(lambda: model(tokens[-chunk:], last, kv)),
            },
        }
        per_row = -(-(decode_ctx + 1) // BLOCK)
        rows = [
            (
                decode_ctx,
                1,
                list(range(blocks_prompt + r * per_row, blocks_prompt + (r + 1) * per_row)),
                True,
            )
            for r in range(decode_rows)
        ]
        batch = ForwardBatch.build(rows, BLOCK, "cuda")
        ids = tokens[:decode_rows]
        out["decode"] = {
            "rows": decode_rows,
            "context": decode_ctx,
            **profiled(lambda: model(ids, batch, kv)),
        }
    print(json.dumps(out)[:3000], flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument(
        "--cases",
        default="deepseek-v2-lite:4:32768:4096:512:4096,deepseek-v32-bench:4:32768:4096:512:4096",
    )
    p.add_argument("--out", required=True)
    a = p.parse_args()
    results = []
    for case in a.cases.split(","):
        shape, *nums = case.split(":")
        results.append(run(shape, *map(int, nums)))
    with open(a.out, "w") as f:
        json.dump({"env": {"torch": torch.__version__}, "cases": results}, f, indent=1)


if __name__ == "__main__":
    main()
