"""The MXFP4 grouped MoE (W4A16: packed e2m1 experts dequantized in the kernel) against the FP8
grouped MoE (W8A8) and the bf16 one on one GPU, at V4-Flash's routed experts (256 of hidden
4096, width 2048, top-6): decode batches of 1, 64 and 512 rows and an 8K-token prefill chunk.
Per backend: ms, the expert weights' read rate (the experts the batch touches, in that format's
bytes, scales included) and TFLOP/s; and the MXFP4 kernel's error against the dequantized
reference (mxfp4.moe_experts) at 64 rows. The MXFP4 kernel runs on tl.dot_scaled (Triton's own
e2m1 upcast); "mxfp4 own-dequant" is the same tiles on its integer dequantizer and tl.dot.

    python -m app.bench.mxfp4 --out docs/bench/mxfp4_moe.json
    python -m app.bench.mxfp4 --sweep --out docs/bench/mxfp4_tiles.json   # MXFP4 tiles only
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from typing import Any, Callable

import torch

from stages.kernels import fp8_ref, mxfp4

# (experts, top-k, hidden, width): V4-Flash's routed experts (app/bench/target.py's shape)
V4_FLASH = (256, 6, 4096, 2048)
ROWS = (1, 64, 512, 8192)
FORMATS = ("bf16", "fp8", "mxfp4")
# (block_m, block_n, block_k, warps, stages, dot_scaled) tried per row count with --sweep
SWEEP = (
    (16, 64, 128, 4, 4, True),
    (16, 64, 128, 4, 4, False),
    (16, 128, 128, 4, 4, True),
    (16, 64, 256, 4, 3, True),
    (32, 64, 128, 4, 4, True),
    (64, 128, 128, 4, 3, True),
    (64, 128, 128, 4, 3, False),
    (64, 128, 64, 8, 4, True),
    (128, 128, 64, 8, 3, True),
    (128, 128, 64, 8, 3, False),
    (128, 256, 64, 8, 3, True),
)


def experts(
    shape: tuple[int, int, int, int] = V4_FLASH, formats: tuple[str, ...] = FORMATS
) -> dict[str, Any]:
    """The same random experts in each of `formats` (of FORMATS: bf16, FP8 with 128 x 128
    blocks, MXFP4), one expert at a time (the fp32 draws stay small; the draws do not depend on
    the formats asked for)."""
    e, _k, h, inter = shape
    out: dict[str, Any] = {}
    for name, rows, cols, div in (("gate_up", 2 * inter, h, 60), ("down", h, inter, 40)):
        held: dict[str, Any] = {}
        if "bf16" in formats:
            held["bf16"] = torch.empty(e, rows, cols, dtype=torch.bfloat16, device="cuda")
        if "fp8" in formats:
            held["fp8"] = (
                torch.empty(e, rows, cols, dtype=fp8_ref.FP8, device="cuda"),
                torch.empty(e, rows // 128, cols // 128, device="cuda"),
            )
        if "mxfp4" in formats:
            held["mxfp4"] = (
                torch.empty(e, rows, cols // 2, dtype=torch.uint8, device="cuda"),
                torch.empty(e, rows, cols // mxfp4.GROUP, dtype=torch.uint8, device="cuda"),
            )
        g = torch.Generator(device="cuda").manual_seed(len(name))
        for i in range(e):
            w = torch.randn(rows, cols, generator=g, device="cuda") / div
            if "bf16" in held:
                held["bf16"][i] = w
            if "fp8" in held:
                held["fp8"][0][i], held["fp8"][1][i] = fp8_ref.quantize_weight(w)
            if "mxfp4" in held:
                held["mxfp4"][0][i], held["mxfp4"][1][i] = mxfp4.quantize(w)
        out[name] = held
    return out


def expert_bytes(fmt: str, h: int, inter: int) -> float:
    """Bytes one expert's three matrices take in `fmt`, scales included."""
    values = 3 * h * inter
    return {
        "bf16": 2.0 * values,
        "fp8": values + 4.0 * values / 128**2,
        "mxfp4": values * (0.5 + 1 / mxfp4.GROUP),
    }[fmt]


def runs(
    w: dict[str, Any], x: torch.Tensor, ids: torch.Tensor, wt: torch.Tensor
) -> dict[str, Callable[[], torch.Tensor]]:
    from stages.kernels import triton_moe, triton_moe_fp8, triton_moe_mxfp4

    gu, dn = w["gate_up"], w["down"]
    (g8, g8s), (d8, d8s) = gu["fp8"], dn["fp8"]
    (g4, g4s), (d4, d4s) = gu["mxfp4"], dn["mxfp4"]
    from stages.kernels.triton_gemm import num_sms

    t, k = ids.shape
    own = replace(triton_moe_mxfp4.tiles_for(t * k, g4.shape[0]), dot_scaled=False)
    grid = num_sms(x.device)
    return {
        "bf16": lambda: triton_moe.moe_experts(x, gu["bf16"], dn["bf16"], ids, wt),
        "fp8": lambda: triton_moe_fp8.moe_experts(x, g8, g8s, d8, d8s, ids, wt),
        "mxfp4": lambda: triton_moe_mxfp4.moe_experts(x, g4, g4s, d4, d4s, ids, wt),
        # the same tiles on the kernel's own integer dequantizer instead of tl.dot_scaled
        "mxfp4 own-dequant": lambda: triton_moe_mxfp4.run_moe(
            x, g4, g4s, d4, d4s, ids, wt, grid, own
        ),
    }


def batch(t: int, shape: tuple[int, int, int, int] = V4_FLASH) -> tuple[torch.Tensor, ...]:
    e, k, h, _inter = shape
    g = torch.Generator(device="cuda").manual_seed(t)
    x = torch.randn(t, h, generator=g, device="cuda").bfloat16()
    ids = torch.rand(t, e, generator=g, device="cuda").topk(k, dim=-1).indices
    wt = torch.rand(t, k, generator=g, device="cuda")
    return x, ids, wt


def compare_rows(
    w: dict[str, Any], shape: tuple[int, int, int, int] = V4_FLASH
) -> list[dict[str, Any]]:
    import triton.testing

    e, k, h, inter = shape
    rows = []
    for t in ROWS:
        x, ids, wt = batch(t, shape)
        touched = int(ids.unique().numel())
        flops = 2 * t * k * 3 * h * inter
        for fmt, fn in runs(w, x, ids, wt).items():
            ms = triton.testing.do_bench(fn)
            row: dict[str, Any] = {
                "rows": t,
                "experts": e,
                "top_k": k,
                "weights": fmt,
                "ms": round(ms, 4),
                "experts_touched": touched,
                "weights_tb_s": round(
                    touched * expert_bytes(fmt.split()[0], h, inter) / ms / 1e9, 3
                ),
                "tflops": round(flops / ms / 1e9, 1),
            }
            if fmt.startswith("mxfp4") and t == 64:
                (gq, gs), (dq, ds) = w["gate_up"]["mxfp4"], w["down"]["mxfp4"]
                ref = mxfp4.moe_experts(x, gq, gs, dq, ds, ids, wt)
                got = fn().float()
                row["rel_err_vs_dequantized"] = float((got - ref.float()).norm() / ref.norm())
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def sweep_rows(
    w: dict[str, Any], shape: tuple[int, int, int, int] = V4_FLASH
) -> list[dict[str, Any]]:
    """The MXFP4 kernel per tile configuration at each row count."""
    import triton.testing

    from stages.kernels import triton_moe_mxfp4 as moe
    from stages.kernels.triton_gemm import num_sms

    e, k, h, inter = shape
    rows = []
    for t in ROWS:
        x, ids, wt = batch(t, shape)
        touched = int(ids.unique().numel())
        for bm, bn, bk, warps, stages, scaled in SWEEP:
            tiles = moe.Mxfp4Tiles(bm, bn, bk, warps, stages, dot_scaled=scaled)
            (gq, gs), (dq, ds) = w["gate_up"]["mxfp4"], w["down"]["mxfp4"]
            grid = num_sms(x.device)
            try:
                ms = triton.testing.do_bench(
                    lambda: moe.run_moe(x, gq, gs, dq, ds, ids, wt, grid, tiles)
                )
                row: dict[str, Any] = {
                    "ms": round(ms, 4),
                    "weights_tb_s": round(touched * expert_bytes("mxfp4", h, inter) / ms / 1e9, 3),
                    "tflops": round(2 * t * k * 3 * h * inter / ms / 1e9, 1),
                }
            except Exception as err:  # a configuration that does not compile or fit
                row = {"error": f"{type(err).__name__}: {err}"[:160]}
            row = {"rows": t, "tiles": [bm, bn, bk, warps, stages], "dot_scaled": scaled, **row}
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default=None)
    p.add_argument("--sweep", action="store_true", help="only the MXFP4 kernel's tile sweep")
    a = p.parse_args(argv)
    w = experts()
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "shape": dict(zip(("experts", "top_k", "hidden", "width"), V4_FLASH)),
    }
    if a.sweep:
        result["mxfp4_tiles"] = sweep_rows(w)
    else:
        result["moe"] = compare_rows(w)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
