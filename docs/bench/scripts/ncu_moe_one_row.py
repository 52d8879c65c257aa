"""The FP8 MoE of a one-row V4-Flash decode step (7 experts: top-6 and one more as the shared
expert's slot), its two grouped kernels launched a few times, for Nsight Compute on the GPU host:

    ncu -k regex:_grouped_w8a8 --launch-skip 4 --launch-count 2 --section SpeedOfLight \
        --section WarpStateStats --section MemoryWorkloadAnalysis \
        python3 docs/bench/scripts/ncu_moe_one_row.py

(the fused gate/up SwiGLU kernel, then the down GEMM, of the third call)."""

import torch

from stages.kernels import fp8_ref, triton_moe_fp8

e, k, h, inter, limit = 257, 7, 4096, 2048, 10.0
gq, gs = fp8_ref.quantize_weight(torch.randn(e, 2 * inter, h, device="cuda") / 60)
dq, ds = fp8_ref.quantize_weight(torch.randn(e, h, inter, device="cuda") / 60)
x = torch.randn(1, h, device="cuda").bfloat16()
ids = torch.randperm(e - 1, device="cuda")[: k - 1]
ids = torch.cat((ids, torch.tensor([e - 1], device="cuda")))[None]
w = torch.rand(1, k, device="cuda")
for _ in range(3):
    triton_moe_fp8.moe_experts(x, gq, gs, dq, ds, ids, w, limit=limit)
torch.cuda.synchronize()
print("done")
