"""V4-Flash's W8A8 decode linears: the tensor-core decode kernel (stages/kernels/
triton_fp8_decode_linear.py) against cuBLASLt's block-scaled GEMM with its quantizer launch, by
time, weight bandwidth and bits.

    python -m app.bench.fp8_decode_linear [--rows 1,16,64] [--out F.json]

Bits: whether a row computed at M rows equals the same row computed in a 512-row batch, by the
decode kernel against the Triton block-scaled GEMM (triton-persistent, its arithmetic) and
cuBLASLt, and cuBLASLt's rows at M against at 512: where a row's arithmetic follows its batch.
Times: one CUDA graph of calls over enough copies of the weights to pass L2 (COPY_BYTES), so a
call streams its weights from HBM and no launch waits on the host (session 34's first run timed
single calls with triton.testing.do_bench: its few-microsecond GEMMs took 200 us, the host's
launches); the median of the graph's replays, per call, in us.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch

from stages.kernels import fp8_gemm, fp8_ref, triton_fp8_decode_linear

# (name, N, K): a V4-Flash layer's W8A8 linears at decode (x_proj's width as an HCA layer's)
LINEARS = [
    ("x_proj", 2560, 4096),
    ("q_b", 32768, 1024),
    ("o_b", 4096, 8192),
    ("indexer q_b", 8192, 1024),
]
BATCH = 512
COPY_BYTES = 256 << 20  # the weights' copies a graph cycles through: past the H200's 50 MB L2
# (BLOCK_W, STAGES) of the decode kernel swept beside its default
SWEEP = [(64, 4), (64, 8), (128, 6)]


def _same(a: torch.Tensor, b: torch.Tensor) -> dict[str, Any]:
    diff = (a.float() - b.float()).abs()
    return {"equal": bool(torch.equal(a, b)), "max_abs": float(diff.max())}


def _time(fn: Any, weights: list[tuple[torch.Tensor, torch.Tensor]], reps: int = 20) -> float:
    """us a call of fn(weight, scale) in a CUDA graph that calls it once per copy."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up (compiles, picks cuBLASLt's algorithm) off-graph
        for w, ws in weights[:2]:
            fn(w, ws)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w, ws in weights:
            fn(w, ws)
    times: list[float] = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(float(start.elapsed_time(end)) * 1e3 / len(weights))
    return sorted(times)[len(times) // 2]


def rows_for(m: int, name: str, n: int, k: int, seed: int) -> dict[str, Any]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(BATCH, k, generator=g, device="cuda").bfloat16()
    w = (
        torch.randn(n, k, generator=g, device="cuda")
        * torch.logspace(-2, 0, n, device="cuda")[:, None]
    )
    wq, ws = fp8_ref.quantize_weight(w)
    xm = x[:m].contiguous()
    decode = triton_fp8_decode_linear.linear(xm, wq, ws)
    cublas = fp8_gemm.linear_scaled_mm(xm, wq, ws)
    persistent = fp8_gemm.linear(x, wq, ws)[:m]
    cublas_batch = fp8_gemm.linear_scaled_mm(x, wq, ws)[:m]
    ref = fp8_ref.linear(xm.float(), wq, ws)
    weight_bytes = n * k + ws.numel() * 4
    row: dict[str, Any] = {"layer": name, "M": m, "N": n, "K": k}
    row["rel_err"] = float((decode.float() - ref).norm() / ref.norm())
    row["bits"] = {
        "decode_vs_persistent_512": _same(decode, persistent),
        "decode_vs_cublas_same_m": _same(decode, cublas),
        "decode_vs_cublas_512": _same(decode, cublas_batch),
        "cublas_vs_cublas_512": _same(cublas, cublas_batch),
    }
    copies = [(wq, ws)] + [
        (wq.clone(), ws.clone()) for _ in range(max(1, -(-COPY_BYTES // weight_bytes) - 1))
    ]
    times: dict[str, float | str | None] = {
        "decode": _time(lambda w, s: triton_fp8_decode_linear.linear(xm, w, s), copies),
        "scaled-mm": _time(lambda w, s: fp8_gemm.linear_scaled_mm(xm, w, s), copies),
    }
    for block_w, stages in SWEEP:
        try:
            times[f"decode {block_w}x{stages}"] = _time(
                lambda w, s, b=block_w, st=stages: triton_fp8_decode_linear._launch(
                    xm, w, s, None, False, None, block_w=b, stages=st
                ),
                copies,
            )
        except Exception as e:  # a launch that does not fit is a result too
            times[f"decode {block_w}x{stages}"] = f"{type(e).__name__}: {e}"[:160]
    del copies
    row["us"] = {k_: round(v, 2) if isinstance(v, float) else v for k_, v in times.items()}
    row["weight_TB_s"] = {
        k_: round(weight_bytes / (v * 1e-6) / 1e12, 2)
        for k_, v in times.items()
        if isinstance(v, float)
    }
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,2,16,32")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "rows": []}
    for m in (int(r) for r in a.rows.split(",")):
        for i, (name, n, k) in enumerate(LINEARS):
            row = rows_for(m, name, n, k, seed=m * 10 + i)
            print(json.dumps(row), flush=True)
            result["rows"].append(row)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
