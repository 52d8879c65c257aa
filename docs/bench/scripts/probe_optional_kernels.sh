#!/usr/bin/env bash
# Does an optional kernel package load next to the host's torch? Installs each wheel with --no-deps
# into its own folder (the host's torch stays), imports it and runs one small call.
# Wheels: `pip download --no-deps --python-version 3.12 --only-binary=:all: <pkg>==<v>` (the GPU host
# has no registry); vllm-flash-attn's wheel unpacked and re-packed as vfa.tar.xz to fit the carry.
set -u
WHEELS=${1:?folder with the wheels}
for whl in "$WHEELS"/sgl_deep_gemm-*.whl; do
  dir=/tmp/dg_$(basename "$whl" .whl); rm -rf "$dir"
  python3 -m pip install -q --no-deps --no-index --target "$dir" "$whl" 2>&1 | tail -2
  echo "== $(basename "$whl")"
  PYTHONPATH=$dir timeout 300 python3 - <<'PY' 2>&1 | tail -8
import torch, deep_gemm
names = [n for n in dir(deep_gemm) if "bf16" in n or "gemm" in n.lower()]
print("imported; functions:", names)
a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
for n in names:
    if "bf16" not in n: continue
    d = torch.empty(4096, 4096, device="cuda", dtype=torch.bfloat16)
    try:
        getattr(deep_gemm, n)(a, b, d); torch.cuda.synchronize()
        print(n, "ran; max abs diff vs a@b.T:", float((d.float() - (a @ b.T).float()).abs().max()))
    except Exception as e:
        print(n, "failed:", type(e).__name__, str(e)[:300])
PY
done
echo "== vllm-flash-attn 2.6.2 (cp312, --no-deps)"
rm -rf /tmp/vfa && mkdir -p /tmp/vfa && tar -C /tmp/vfa -xJf "$WHEELS/vfa.tar.xz"
PYTHONPATH=/tmp/vfa timeout 300 python3 -c "
import torch, vllm_flash_attn
from vllm_flash_attn import flash_attn_varlen_func
print('imported', vllm_flash_attn.__version__)
" 2>&1 | tail -5
