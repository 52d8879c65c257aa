"""DeepSeek-V3.2 sparse attention kernels alone on one GPU: FlashMLA's sparse prefill (bf16
latent) and sparse decode (FP8 latent), at the shapes of the issue (top-2048, 64 and 128 query
heads). The with-a-waiting-recv half is app.bench.contention's (2 GPUs).

    python -m app.bench.sparse_mla --out docs/bench/sparse_mla.json
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch

from app.bench.attention import cuda_median_ms
from app.bench.target import environment
from stages.kernels import flash_mla, fp8_latent, torch_ref, triton_indexer

TOPK = 2048
SCALE = 192 ** -0.5


def _indices(rows: int, keys: int, g: torch.Generator) -> torch.Tensor:
    """TOPK random keys per row among `keys` (sampled with replacement, as the kernel allows)."""
    return torch.randint(0, keys, (rows, TOPK), generator=g, device="cuda", dtype=torch.int32)


def prefill_case(heads: int, queries: int, keys: int, g: torch.Generator) -> dict[str, Any]:
    q = torch.randn(queries, heads, 576, generator=g, device="cuda").bfloat16()
    kv = (torch.randn(keys, 1, 576, generator=g, device="cuda") / 4).bfloat16()
    idx = _indices(queries, keys, g)
    ms = cuda_median_ms(lambda: flash_mla.mla_sparse(q, kv, idx, 512, SCALE), reps=10)
    return {"kernel": "sparse_prefill_bf16", "heads": heads, "queries": queries, "keys": keys,
            "topk": TOPK, "ms": round(ms, 4)}


def decode_case(heads: int, rows: int, keys: int, g: torch.Generator) -> dict[str, Any]:
    q = torch.randn(rows, heads, 576, generator=g, device="cuda").bfloat16()
    latent = (torch.randn(keys, 576, generator=g, device="cuda") / 4).bfloat16()
    pages = fp8_latent.quantize(latent).view(-1, 64, 1, fp8_latent.BYTES)
    idx = _indices(rows, keys, g)
    state: dict[str, Any] = {}
    fp8 = cuda_median_ms(
        lambda: flash_mla.mla_sparse_fp8_decode(q, pages, idx, 512, SCALE, state), reps=20)
    kv = latent.view(keys, 1, 576)
    bf16 = cuda_median_ms(lambda: flash_mla.mla_sparse(q, kv, idx, 512, SCALE), reps=20)
    return {"kernel": "sparse_decode", "heads": heads, "rows": rows, "keys": keys, "topk": TOPK,
            "fp8_decode_ms": round(fp8, 4), "bf16_prefill_kernel_ms": round(bf16, 4)}


def indexer_case(queries: int, keys: int, g: torch.Generator) -> dict[str, Any]:
    """V3.2's indexer: 64 heads of 128, bf16 (the torch reference on its bf16 matmuls)."""
    q = torch.randn(queries, 64, 128, generator=g, device="cuda").bfloat16()
    k = torch.randn(keys, 128, generator=g, device="cuda").bfloat16()
    w = torch.randn(queries, 64, generator=g, device="cuda")
    triton = cuda_median_ms(lambda: triton_indexer.indexer_logits(q, k, w, 128 ** -0.5), reps=5)
    ref = cuda_median_ms(lambda: torch_ref.indexer_logits(q, k, w, 128 ** -0.5), reps=3)
    logits = triton_indexer.indexer_logits(q, k, w, 128 ** -0.5)
    topk = cuda_median_ms(lambda: logits.topk(TOPK, dim=-1), reps=3)
    return {"kernel": "indexer_logits", "heads": 64, "head_dim": 128, "queries": queries,
            "keys": keys, "triton_ms": round(triton, 3), "torch_ms": round(ref, 3),
            "topk_2048_ms": round(topk, 3),
            "triton_tflops": round(2 * queries * keys * 64 * 128 / triton / 1e9, 1)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if not flash_mla.is_available("cuda"):
        raise SystemExit("needs an SM90 GPU and the sgl-flash-mla wheel")
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for heads in (64, 128):
        for queries, keys in ((4096, 32768), (4096, 131072)):
            rows.append(prefill_case(heads, queries, keys, g))
            print(rows[-1], flush=True)
        for n in (256, 512, 1024):
            rows.append(decode_case(heads, n, 16384, g))
            print(rows[-1], flush=True)
    for keys in (32768, 131072):
        rows.append(indexer_case(4096, keys, g))
        print(rows[-1], flush=True)
    report = {"command": "python -m app.bench.sparse_mla " + " ".join(sys.argv[1:]),
              "environment": environment(), "rows": rows}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
