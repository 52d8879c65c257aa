"""DeepGEMM's smallest calls on SM90, in this one process, in the order named on the command line
(an adapted copy of docs/bench/scripts/session12_dg_probe.py; DeepGEMM 2.6.1's API is the one that
probe used). Run with `python3 -X faulthandler` and LD_PRELOAD=/tmp/segv.so (probe.sh does).

  python3 .gpu-deepgemm/dg_probe.py [CALL ...]     CALL: cublaslt transpose_fp32 bf16_gemm_nt
                                                   fp8_gemm_nt (default: cublaslt bf16_gemm_nt
                                                   fp8_gemm_nt, session 12's order)
  DG_PROBE_M: M of the GEMMs (default 256; N 512, K 1024)

transpose_fp32 is DeepGEMM's simplest JIT kernel (get_mn_major_tma_aligned_tensor on a contiguous
fp32 scale tensor): no GEMM heuristics, no TMA descriptor, the same generate -> include hash ->
nvcc -> cubin load -> launch path. C's stdout is made unbuffered first: DeepGEMM's C++ printf
(DG_JIT_DEBUG's generated code, NVCC command, "Loading CUBIN", "Launch kernel") otherwise sits
in a block buffer when stdout is a file or pipe and dies with the process on a segfault."""

import ctypes
import os
import sys

libc = ctypes.CDLL(None)
libc.setvbuf(ctypes.c_void_p.in_dll(libc, "stdout"), None, 2, 0)  # _IONBF, before any C output

import deep_gemm  # noqa: E402
import torch  # noqa: E402
from deep_gemm.utils import per_block_cast_to_fp8, per_token_cast_to_fp8  # noqa: E402

calls = sys.argv[1:] or ["cublaslt", "bf16_gemm_nt", "fp8_gemm_nt"]
prop = torch.cuda.get_device_properties(0)
print(
    f"deep_gemm {deep_gemm.__version__} from {deep_gemm.__file__}; torch {torch.__version__} "
    f"(cuda {torch.version.cuda}); {prop.name} sm_{prop.major}{prop.minor}; "
    f"num_sms {deep_gemm.get_num_sms()}; pid {os.getpid()}",
    flush=True,
)
dg_env = {k: v for k, v in sorted(os.environ.items()) if k.startswith(("DG_", "CUDA_HOME"))}
print("env:", dg_env, flush=True)

m, n, k = int(os.environ.get("DG_PROBE_M", "256")), 512, 1024
a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
ref = a.float() @ b.float().t()
d = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
sf = torch.rand(m, k // 128, device="cuda", dtype=torch.float32)
mn_major = (
    getattr(deep_gemm, "get_mn_major_tma_aligned_tensor", None)
    or deep_gemm._C.get_mn_major_tma_aligned_tensor
)


def gemm_err() -> str:
    return f"rel err {((d.float() - ref).norm() / ref.norm()).item():.4f}"


def transpose_fp32() -> str:
    out = mn_major(sf)
    torch.cuda.synchronize()
    return f"equal {torch.equal(out, sf)}, strides {tuple(out.stride())}"


def fp8_gemm_nt() -> str:
    deep_gemm.fp8_gemm_nt(
        per_token_cast_to_fp8(a, use_ue8m0=False),
        per_block_cast_to_fp8(b, use_ue8m0=False),
        d,
        disable_ue8m0_cast=True,
    )
    return gemm_err()


def gemm(fn):
    def run() -> str:
        fn()
        return gemm_err()

    return run


CALLS = {
    "cublaslt": gemm(lambda: deep_gemm.cublaslt_gemm_nt(a, b, d)),
    "transpose_fp32": transpose_fp32,
    "bf16_gemm_nt": gemm(lambda: deep_gemm.bf16_gemm_nt(a, b, d)),
    "fp8_gemm_nt": fp8_gemm_nt,
}
for name in calls:
    print(f"calling {name}", flush=True)
    try:
        d.zero_()
        result = CALLS[name]()
        torch.cuda.synchronize()
        print(f"  {name}: ok, {result}", flush=True)
    except Exception as e:  # a Python-level refusal (not a crash): print it and go on
        print(f"  {name}: {type(e).__name__}: {str(e)[:800]}", flush=True)
print("probe done", flush=True)
