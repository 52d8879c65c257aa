"""Session 13: tile sweeps of the rope_tail kernel and of the hyper-connections' _project at
V4-Flash's shapes (one H200). Prints JSON lines; ms by triton.testing.do_bench."""

import json
import sys

import torch
import triton
from triton.testing import do_bench

from stages.kernels import triton_hyper, triton_rope

out = open(sys.argv[1], "w") if len(sys.argv) > 1 else sys.stdout


def emit(**row):
    print(json.dumps(row), file=out, flush=True)


g = torch.Generator(device="cuda").manual_seed(0)
for t, norm in ((8192, True), (8192, False), (512, True), (1, True), (1, False)):
    x = torch.randn(t, 64, 512, generator=g, device="cuda").bfloat16()
    theta = torch.rand(t, 32, generator=g, device="cuda")
    cos = theta.cos().repeat_interleave(2, -1).contiguous()
    sin = torch.stack((-theta.sin(), theta.sin()), -1).flatten(-2).contiguous()
    eps = 1e-6 if norm else None
    for elements in (512, 1024, 2048, 4096, 8192, 16384):
        for warps in (2, 4, 8):
            ms = do_bench(lambda: triton_rope.launch(x, cos, sin, eps, elements, warps), rep=50)
            moved = x.numel() * 2 * 2 if norm else t * 64 * 64 * 2 * 2
            emit(kernel="rope_tail", t=t, norm=norm, elements=elements, warps=warps,
                 ms=round(ms, 4), tb_s=round(moved / ms / 1e9, 3))

n, d = 4, 4096
m, k = (2 + n) * n, n * d
fn = torch.randn(m, k, generator=g, device="cuda") * k**-0.5
for t in (8192, 512, 1):
    x = torch.randn(t, n, d, generator=g, device="cuda").bfloat16().reshape(t, k)
    ref = None
    for block_t in (16, 32, 64, 128):
        for block_k in (64, 128, 256):
            for warps in (4, 8):
                blocks = triton.cdiv(t, block_t)
                split = max(1, min(triton_hyper.MAX_SPLIT, triton_hyper.TARGET_PROGRAMS // blocks,
                                   triton.cdiv(k, block_k)))
                kps = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
                split = triton.cdiv(k, kps)
                parts = torch.empty(split, t, m, device="cuda")
                sq = torch.empty(split, t, device="cuda")

                def run():
                    triton_hyper._project[(blocks, split)](
                        x, fn, parts, sq, t, k, m, kps, BLOCK_T=block_t, BLOCK_K=block_k,
                        BLOCK_M=32, PRECISION="bf16x3", num_warps=warps)

                try:
                    ms = do_bench(run, rep=50)
                except Exception as e:  # noqa: BLE001 - a tile that does not compile
                    emit(kernel="_project", t=t, block_t=block_t, block_k=block_k, warps=warps,
                         error=repr(e)[:200])
                    continue
                total = parts.sum(0)
                if ref is None:
                    ref = total.clone()
                err = ((total - ref).abs().max() / ref.abs().max()).item()
                emit(kernel="_project", t=t, block_t=block_t, block_k=block_k, warps=warps,
                     split=split, ms=round(ms, 4), rel_err_vs_first=err)
