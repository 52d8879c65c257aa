"""Where the first run of a new prompt length loses time: each hot op's first call on a new
shape against a repeat of the same call (host wall time around a synchronised call).

  python docs/bench/scripts/probe_first_run.py OUT.json     (one GPU; run once per setting of
                                                             TORCH_CUDNN_SDPA_AVOID_RECOMPILE)
Shapes are the Llama-3-8B ones of `ppserve bench`: chunk attention of C queries after every
prefix of a 128K prompt in C steps, ragged last chunks, and the MLP's up projection for those
chunk lengths on cuBLAS and on the Triton persistent GEMM.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings

import torch

from stages.kernels import cudnn_attention, triton_gemm

HQ, HKV, D, HIDDEN, MLP = 32, 8, 128, 4096, 14336


def timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def first_and_repeat(fn) -> dict:
    first = timed(fn)
    repeat = min(timed(fn) for _ in range(3))
    return {"first_ms": 1e3 * first, "repeat_ms": 1e3 * repeat,
            "penalty_ms": 1e3 * (first - repeat)}


def main(out: str) -> None:
    dev, bf16 = "cuda", torch.bfloat16
    chunk = int(os.environ.get("CHUNK", "4096"))
    total = int(os.environ.get("TOTAL", "131072"))
    scale = D ** -0.5
    k = torch.randn(total + chunk, HKV, D, device=dev, dtype=bf16)
    v = torch.randn_like(k)
    rows = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        q = torch.randn(chunk, HQ, D, device=dev, dtype=bf16)
        cudnn_attention.attention(q[:512], k[:1024], v[:1024], scale)  # handles, first graph
        for length in range(chunk, total + 1, chunk):  # every prefix of one lone prompt
            r = first_and_repeat(
                lambda: cudnn_attention.attention(q, k[:length], v[:length], scale))
            rows.append({"op": "attention", "queries": chunk, "keys": length, **r})
        for t in (3000, 3001, 5000, 777):  # ragged last chunks of other prompt lengths
            qt = torch.randn(t, HQ, D, device=dev, dtype=bf16)
            length = 65536 + t
            r = first_and_repeat(
                lambda: cudnn_attention.attention(qt, k[:length], v[:length], scale))
            rows.append({"op": "attention", "queries": t, "keys": length, **r})
        w = torch.randn(MLP, HIDDEN, device=dev, dtype=bf16)
        for m in (chunk, 3000, 3001, 5000, 777):
            x = torch.randn(m, HIDDEN, device=dev, dtype=bf16)
            rows.append({"op": "linear_cublas", "m": m,
                         **first_and_repeat(lambda: torch.nn.functional.linear(x, w))})
            if triton_gemm.is_available(dev):
                rows.append({"op": "linear_triton", "m": m,
                             **first_and_repeat(lambda: triton_gemm.linear(x, w))})
    total_penalty = sum(r["penalty_ms"] for r in rows if r["op"] == "attention")
    result = {"avoid_recompile": os.environ.get("TORCH_CUDNN_SDPA_AVOID_RECOMPILE"),
              "cudnn": torch.backends.cudnn.version(), "torch": torch.__version__,
              "chunk": chunk, "attention_penalty_total_ms": total_penalty,
              "warnings": sorted({str(w.message)[:200] for w in caught}), "rows": rows}
    json.dump(result, open(out, "w"), indent=1)
    for r in rows:
        print(r)
    print("attention first-call penalty, total ms:", round(total_penalty, 1))
    print("warnings:", result["warnings"])


if __name__ == "__main__":
    main(sys.argv[1])
