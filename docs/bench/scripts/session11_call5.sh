#!/usr/bin/env bash
# Session 11, diagnostics on one H200 (no Ray): the 256K chunk's FP8 breakdown with kernel names
# to 240 characters (an unnamed 7.95 ms elementwise kernel came with the candidates' top-k), and
# a profile of 512 decode rows' indexer scores over FP8 against bf16 keys (3x slower over FP8).
set -u
R=$OUT/r; mkdir -p "$R"
timeout 200 python -m app.bench.deepseek_breakdown --linear auto --quantization fp8 --kv-cache-dtype fp8 \
  --cases deepseek-v4-flash:8:262144:8192:512:512 --out "$R/breakdown_fp8_names.json" > "$R/breakdown.log" 2>&1
echo "breakdown rc $?"
timeout 200 python - > "$R/decode_profile.log" 2>&1 <<'PY'
import torch
from torch.profiler import ProfilerActivity, profile
from stages.kernels import fp8_indexer, triton_indexer
from stages.kernels.indexer_select import SelectPlan
g = torch.Generator(device="cuda").manual_seed(0)
rows, length = 512, 65536
keys = torch.randn(rows * length, 128, generator=g, device="cuda").bfloat16()
perm = torch.randperm(rows * length, generator=g, device="cuda")
plan = SelectPlan.build([(r, 1, length - 1, perm[r * length:(r + 1) * length], True) for r in range(rows)], torch.device("cuda"))
q = torch.randn(rows, 64, 128, generator=g, device="cuda").bfloat16()
w = torch.randn(rows, 64, generator=g, device="cuda")
for name, ks in (("bf16", keys), ("fp8", fp8_indexer.quantize(keys))):
    for _ in range(3):
        triton_indexer.indexer_logits_rows(q, ks, w, 0.088, plan)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            triton_indexer.indexer_logits_rows(q, ks, w, 0.088, plan)
        torch.cuda.synchronize()
    print("==", name)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=90))
PY
echo "profile rc $?"
tar czf "$OUT/results.tgz" -C "$OUT" r
