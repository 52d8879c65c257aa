"""Whether DeepGEMM's kernels run here at all, asked of a child process before app.bench.deepgemm
times them: a crash in DeepGEMM's JIT would otherwise end the bench and lose its JSON."""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Any

# One small dense FP8 GEMM in a child process: on the H200 host (torch 2.11, CUDA 13.0) DeepGEMM
# 2.6.1 built from source imports, then its first JIT kernel segfaults (docs/bench/session12), which
# would take this process and the JSON with it
PROBE = """
import torch, deep_gemm
a = torch.randn(256, 512, device="cuda").to(torch.float8_e4m3fn)
b = torch.randn(256, 512, device="cuda").to(torch.float8_e4m3fn)
sa = deep_gemm.get_mn_major_tma_aligned_tensor(torch.ones(256, 4, device="cuda"))
d = torch.empty(256, 256, dtype=torch.bfloat16, device="cuda")
deep_gemm.fp8_gemm_nt((a, sa), (b, torch.ones(2, 4, device="cuda")), d)
torch.cuda.synchronize()
print("ok")
"""


def probe_kernel(timeout_s: float = 300.0) -> dict[str, Any]:
    """Whether a DeepGEMM kernel compiles and runs, asked of a child process: {"ok": bool,
    "returncode" (negative: the signal that ended it), "seconds", "tail" of its output}."""
    start = time.perf_counter()
    try:
        done = subprocess.run(
            [sys.executable, "-X", "faulthandler", "-c", PROBE],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        rc, out = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as err:
        tail = [x.decode() if isinstance(x, bytes) else x or "" for x in (err.stdout, err.stderr)]
        rc, out = None, f"timed out after {timeout_s} s: " + "".join(tail)
    return {
        "ok": rc == 0,
        "returncode": rc,
        "seconds": round(time.perf_counter() - start, 1),
        "tail": str(out)[-1500:],
    }
