"""MLA prefill chunk attention candidates: one chunk of t queries at the end of an L-token prefix,
q/k 192 and v 128 per head (DeepSeek's expanded form), bf16, bottom-right causal.

    python -m app.bench.mla_attention --out docs/bench/mla_attention.json

TFLOP/s count the FLOPs of the real widths: 2 * heads * t * (L - t / 2) * (192 + 128).
"""

from __future__ import annotations

import argparse
import json

import torch

from app.bench.moe import timed
from stages.kernels import cudnn_attention, torch_ref

QK, V = 192, 128


def candidates() -> dict:
    pad = lambda v: torch.nn.functional.pad(v, (0, QK - V))  # noqa: E731
    out = {
        "sdpa_v128": lambda q, k, v, s: torch_ref.attention(q, k, v, s),
        "sdpa_vpad": lambda q, k, v, s: torch_ref.attention(q, k, pad(v), s)[..., :V],
        "cudnn_split_v128": lambda q, k, v, s: cudnn_attention.split_attention(q, k, v, s),
        "cudnn_split_vpad": lambda q, k, v, s: cudnn_attention.split_attention(q, k, pad(v), s)[
            ..., :V
        ],
    }
    try:
        from stages.kernels import triton_mla

        out["triton"] = triton_mla.mla_prefill
    except ImportError:
        pass
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cases", default="4096:32768:16,4096:131072:16,4096:32768:128,4096:131072:128")
    p.add_argument("--only", default="")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    rows = []
    for case in a.cases.split(","):
        t, length, heads = map(int, case.split(":"))
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(t, heads, QK, generator=g, device="cuda").bfloat16()
        k = torch.randn(length, heads, QK, generator=g, device="cuda").bfloat16()
        v = torch.randn(length, heads, V, generator=g, device="cuda").bfloat16()
        scale = QK**-0.5
        flops = 2 * heads * t * (length - t / 2) * (QK + V)
        ref = None
        for name, fn in candidates().items():
            if a.only and name not in a.only.split(","):
                continue
            row = {"t": t, "L": length, "heads": heads, "candidate": name}
            try:
                out = fn(q, k, v, scale)
                if ref is None:
                    ref = out.float()
                row["rel_err_vs_first"] = ((out.float() - ref).norm() / ref.norm()).item()
                ms = timed(lambda: fn(q, k, v, scale), reps=5)
                row.update(ms=ms, tflops=round(flops / ms / 1e9, 1))
            except Exception as e:
                row["error"] = repr(e)[:300]
            print(json.dumps(row), flush=True)
            rows.append(row)
            torch.cuda.empty_cache()
    with open(a.out, "w") as f:
        json.dump(
            {
                "env": {
                    "torch": torch.__version__,
                    "cudnn": torch.backends.cudnn.version(),
                    "device": torch.cuda.get_device_name(),
                },
                "rows": rows,
            },
            f,
            indent=1,
        )


if __name__ == "__main__":
    main()
