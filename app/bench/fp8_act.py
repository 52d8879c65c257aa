"""The FP8 activation quantizers' launches (`python -m app.bench.fp8 --act-quantizers`): the
1 x 128 quantizer of a GEMM's input and the SwiGLU one of the grouped MoE's down GEMM (its
layout's live rows only), at V4-Flash's widths of an 8K chunk, per (rows a program, warps):
time, the bytes each moves a second, and whether their bits are the current launch's."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch

ACT_LAUNCHES = [(16, 4), (8, 2), (8, 4), (16, 2), (32, 4), (64, 4), (32, 8)]


def act_quantizer_rows(
    launches: list[tuple[int, int]] = ACT_LAUNCHES, tokens: int = 8192
) -> list[dict[str, Any]]:
    import triton.testing

    from stages.kernels import triton_fp8_act
    from stages.kernels.moe_routing import route

    g = torch.Generator(device="cuda").manual_seed(0)
    e, k, hidden, inter, limit = 256, 6, 4096, 2048, 10.0
    ids = torch.rand(tokens, e, generator=g, device="cuda").topk(k, dim=-1).indices
    r = route(ids, torch.rand(tokens, k, generator=g, device="cuda"), e, 128)
    live = r.pair_of_row
    gate_up = torch.randn(live.numel(), 2 * inter, generator=g, device="cuda").bfloat16()
    x = torch.randn(tokens, hidden, generator=g, device="cuda").bfloat16()
    live_rows = int((live >= 0).sum())
    Quantizer = Callable[[], tuple[torch.Tensor, torch.Tensor]]
    cases: dict[str, tuple[str, Quantizer, int]] = {
        "quantize": (
            "LAUNCH",
            lambda: triton_fp8_act.quantize_act(x),
            x.numel() * 2 + x.numel() + tokens * hidden // 128 * 4,
        ),
        "swiglu_quantize": (
            "SWIGLU_LAUNCH",
            lambda: triton_fp8_act.swiglu_quantize_act(gate_up, limit, live=live),
            live_rows * (2 * inter * 2 + inter + inter // 128 * 4),
        ),
    }
    rows = []
    for name, (knob, fn, moved) in cases.items():
        current = getattr(triton_fp8_act, knob)
        want_q, want_s = fn()
        for launch in launches:
            setattr(triton_fp8_act, knob, launch)
            try:
                q, s = fn()
                ms = triton.testing.do_bench(fn)
                real = slice(None) if name == "quantize" else live >= 0
                row = {
                    "case": name,
                    "launch": list(launch),
                    "ms": round(ms, 4),
                    "tb_s": round(moved / ms / 1e9, 2),
                    "same_bits": torch.equal(
                        q[real].view(torch.uint8), want_q[real].view(torch.uint8)
                    )
                    and torch.equal(s[real], want_s[real]),
                }
            except Exception as err:  # a launch that does not compile or run
                row = {"case": name, "launch": list(launch), "error": f"{err}"[:160]}
            finally:
                setattr(triton_fp8_act, knob, current)
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows
