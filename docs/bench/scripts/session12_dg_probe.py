"""Session 12: the smallest DeepGEMM calls on SM90 with DeepGEMM's own quantizers (its tests'
recipe), each in this one process, before app.bench.deepgemm: where a segfault comes from.
Run with `python3 -X faulthandler`."""

import sys

import torch

import deep_gemm
from deep_gemm.utils import per_block_cast_to_fp8, per_token_cast_to_fp8

print("deep_gemm", deep_gemm.__version__, "num_sms", deep_gemm.get_num_sms(), flush=True)
m, n, k = int(sys.argv[1]) if len(sys.argv) > 1 else 256, 512, 1024
a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
ref = a.float() @ b.float().t()
d = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
for name, call in (
    ("cublaslt_gemm_nt bf16", lambda: deep_gemm.cublaslt_gemm_nt(a, b, d)),
    ("bf16_gemm_nt", lambda: deep_gemm.bf16_gemm_nt(a, b, d)),
    (
        "fp8_gemm_nt",
        lambda: deep_gemm.fp8_gemm_nt(
            per_token_cast_to_fp8(a, use_ue8m0=False),
            per_block_cast_to_fp8(b, use_ue8m0=False),
            d,
            disable_ue8m0_cast=True,
        ),
    ),
):
    print("calling", name, flush=True)
    try:
        call()
        torch.cuda.synchronize()
        err = ((d.float() - ref).norm() / ref.norm()).item()
        print(f"  {name}: ok, rel err {err:.4f}", flush=True)
    except Exception as e:  # a Python-level refusal (not a crash): print it and go on
        print(f"  {name}: {type(e).__name__}: {str(e)[:800]}", flush=True)
