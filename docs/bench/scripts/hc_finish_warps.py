"""Probe (session 18): hc_mix's _finish at V4-Flash's 4 x 4096 streams, one to sixteen rows, at
1-16 warps a program (finish_tile picks 16 for a whole 4 x 4096 row); device time a call from
torch.profiler. Usage: python docs/bench/scripts/hc_finish_warps.py OUT.json"""

import json
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from stages.kernels import triton_hyper

N, D, ITERS = 4, 4096, 20
results = []
original = triton_hyper.finish_tile
for rows in (1, 4, 16):
    streams = torch.randn(rows, N, D, device="cuda", dtype=torch.bfloat16)
    fn = torch.randn((2 + N) * N, N * D, device="cuda") * 0.01
    base, scale = torch.randn((2 + N) * N, device="cuda"), torch.ones(3, device="cuda")
    norm = (torch.ones(D, device="cuda"), 1e-6)
    for warps in (1, 2, 4, 8, 16):
        def tile(t: int, n: int, d: int, w: int = warps) -> tuple[int, int, int]:
            block_t, block_d, _ = original(t, n, d)
            return block_t, block_d, w

        triton_hyper.finish_tile = tile
        for _ in range(3):
            ref = triton_hyper.launch_mix(streams, fn, base, scale, ITERS, 1e-6, 1e-6, norm)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(50):
                triton_hyper.launch_mix(streams, fn, base, scale, ITERS, 1e-6, 1e-6, norm)
            torch.cuda.synchronize()
        times: dict[str, float] = {}
        for e in prof.key_averages():
            if e.device_type.name == "CUDA" and e.count >= 50:
                times[e.key] = round(e.device_time_total / e.count, 2)  # us a call
        same = all(torch.equal(a, b) for a, b in zip(ref, triton_hyper.launch_mix(
            streams, fn, base, scale, ITERS, 1e-6, 1e-6, norm)))
        row = {"rows": rows, "warps": warps, "us": times, "deterministic": same}
        print(json.dumps(row), flush=True)
        results.append(row)
triton_hyper.finish_tile = original
json.dump(results, open(sys.argv[1], "w"), indent=1)
