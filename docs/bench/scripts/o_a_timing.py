"""V4-Flash's grouped output projection (o_a: 8 groups of 4096 -> 1024) at decode and prefill
row counts on the device: the FP8 grouped linear's two paths (the decode linear's kernel, its
programs tiling the rows past 32; the pointer GEMM a group) against the bf16 batched GEMM the
stage ran before (V4Attention._grouped_output's bmm), each timed by CUDA events over a CUDA
graph of REPS calls on weight copies that together pass the L2.

    python docs/bench/scripts/o_a_timing.py --rows 1,16,64,512,2048,8192 --out o_a.json
"""

from __future__ import annotations

import argparse
import json

import torch

from stages.kernels import fp8_gemm, fp8_ref, triton_fp8_decode_linear

GROUPS, N, K = 8, 1024, 4096
COPIES = 4  # 4 x 67 MB bf16 (4 x 34 MB FP8) weight copies: past the 50 MB L2
REPS = 8


def bmm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    t = x.shape[0]
    out = x.new_empty(t, GROUPS, N)
    torch.bmm(x.transpose(0, 1), w.view(GROUPS, N, K).transpose(1, 2), out=out.transpose(0, 1))
    return out


def timed_ms(fn) -> float:  # type: ignore[no-untyped-def]
    for _ in range(3):
        fn(0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(REPS):
            fn(i % COPIES)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(10):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (10 * REPS)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="1,16,64,512,2048,8192")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    w = [torch.randn(GROUPS * N, K, device="cuda") * 0.02 for _ in range(COPIES)]
    wq = [fp8_ref.quantize_weight(x) for x in w]
    wb = [x.bfloat16() for x in w]
    del w
    result = {}
    for rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn(rows, GROUPS, K, device="cuda").bfloat16()
        grid = torch.cuda.get_device_properties(0).multi_processor_count
        times = {
            "fp8_decode_kernel": timed_ms(
                lambda i: triton_fp8_decode_linear.grouped_linear(x, *wq[i])
            ),
            "fp8_pointer_gemm": timed_ms(lambda i: fp8_gemm.grouped_gemm(x, *wq[i], grid)),
            "bf16_bmm": timed_ms(lambda i: bmm(x, wb[i])),
        }
        flop = 2 * rows * GROUPS * N * K
        result[rows] = {
            **{f"{name}_ms": round(ms, 4) for name, ms in times.items()},
            **{f"{name}_tflops": round(flop / ms / 1e9, 1) for name, ms in times.items()},
        }
        print(rows, result[rows], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": result}, f, indent=1)


if __name__ == "__main__":
    main()
