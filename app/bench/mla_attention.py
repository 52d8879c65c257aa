"""MLA prefill chunk attention candidates: one chunk of t queries at the end of an L-token prefix,
q/k 192 and v 128 per head (DeepSeek's expanded form), bf16, bottom-right causal.

    python -m app.bench.mla_attention --out docs/bench/mla_attention.json

TFLOP/s count the FLOPs of the real widths: 2 * heads * t * (L - t / 2) * (192 + 128).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

import torch

from app.bench.moe import timed
from stages.kernels import cudnn_attention, torch_ref

QK, V = 192, 128


# (q, k, v, scale) -> the attention output [t, heads, V]
Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


def _pad(v: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(v, (0, QK - V))


def _sdpa_vpad(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: float) -> torch.Tensor:
    return torch_ref.attention(q, k, _pad(v), s)[..., :V]


def _cudnn_vpad(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: float) -> torch.Tensor:
    return cudnn_attention.split_attention(q, k, _pad(v), s)[..., :V]


def candidates() -> dict[str, Attention]:
    return {
        "sdpa_v128": torch_ref.attention,
        "sdpa_vpad": _sdpa_vpad,
        "cudnn_split_v128": cudnn_attention.split_attention,
        "cudnn_split_vpad": _cudnn_vpad,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cases", default="4096:32768:16,4096:131072:16,4096:32768:128,4096:131072:128")
    p.add_argument("--only", default="")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    rows: list[dict[str, Any]] = []
    for case in a.cases.split(","):
        t, length, heads = map(int, case.split(":"))
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(t, heads, QK, generator=g, device="cuda").bfloat16()
        k = torch.randn(length, heads, QK, generator=g, device="cuda").bfloat16()
        v = torch.randn(length, heads, V, generator=g, device="cuda").bfloat16()
        scale = QK**-0.5
        flops = 2 * heads * t * (length - t / 2) * (QK + V)
        ref: torch.Tensor | None = None
        for name, fn in candidates().items():
            if a.only and name not in a.only.split(","):
                continue
            row: dict[str, Any] = {"t": t, "L": length, "heads": heads, "candidate": name}
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
