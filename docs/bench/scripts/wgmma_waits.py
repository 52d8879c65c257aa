"""How Triton schedules the block-scaled FP8 GEMM's warpgroup MMAs on sm_90, read off the
compiled code on a machine with no GPU (session 21): for the grouped W8A8 at its prefill tiles
and for two hand-staggered K loops, whether each MMA is waited on (`wgmma.wait_group 0`) before
anything else runs. Run: `.venv/bin/python docs/bench/scripts/wgmma_waits.py`."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from stages.kernels import triton_moe_fp8  # noqa: E402
from tests.cpu.sm90 import compile_sm90  # noqa: E402


@triton.jit
def staggered(a_ptr, w_ptr, as_ptr, ws_ptr, c_ptr, K, stride_am, stride_wn, stride_as,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              FORM: tl.constexpr):  # fmt: skip
    """FORM 1: the next K block's MMA issued before the last one's product is scaled; FORM 2:
    two K blocks' MMAs issued before either product is scaled."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if FORM == 1:
        p = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        s = tl.zeros((BLOCK_M, 1), dtype=tl.float32)
        for ki in tl.range(0, tl.cdiv(K, BLOCK_K)):
            ks = ki * BLOCK_K + tl.arange(0, BLOCK_K)
            a = tl.load(a_ptr + rows[:, None] * stride_am + ks[None, :])
            w = tl.load(w_ptr + cols[:, None] * stride_wn + ks[None, :])
            q = tl.dot(a, w.T)
            acc += p * s
            p = q
            s = tl.load(as_ptr + rows * stride_as + ki)[:, None] * tl.load(ws_ptr + ki)
        acc += p * s
    else:
        for ki in tl.range(0, tl.cdiv(K, 2 * BLOCK_K)):
            ks = 2 * ki * BLOCK_K + tl.arange(0, BLOCK_K)
            a0 = tl.load(a_ptr + rows[:, None] * stride_am + ks[None, :])
            w0 = tl.load(w_ptr + cols[:, None] * stride_wn + ks[None, :])
            a1 = tl.load(a_ptr + rows[:, None] * stride_am + BLOCK_K + ks[None, :])
            w1 = tl.load(w_ptr + cols[:, None] * stride_wn + BLOCK_K + ks[None, :])
            p0 = tl.dot(a0, w0.T)
            p1 = tl.dot(a1, w1.T)
            s0 = tl.load(as_ptr + rows * stride_as + 2 * ki)[:, None] * tl.load(ws_ptr + 2 * ki)
            s1 = tl.load(as_ptr + rows * stride_as + 2 * ki + 1)[:, None]
            acc += p0 * s0 + p1 * (s1 * tl.load(ws_ptr + 2 * ki + 1))
    tl.store(c_ptr + rows[:, None] * 4096 + cols[None, :], acc.to(tl.bfloat16))


def waits(kernel) -> dict[str, list[str]]:
    return {
        "mma ops": re.findall(r"ttng\.warp_group_dot(?:_wait)? ", kernel.asm["ttgir"]),
        "ptx waits": re.findall(r"wgmma\.wait_group\.sync\.aligned \d+", kernel.asm["ptx"]),
    }


def main() -> None:
    block_m, warps, stages = triton_moe_fp8.PREFILL_TILES
    strides = ("stride_am", "stride_as", "stride_we", "stride_wn", "stride_wse", "stride_wsn",
               "stride_cm")  # fmt: skip
    grouped = compile_sm90(
        triton_moe_fp8._grouped_w8a8,
        {"a_ptr": "*fp8e4nv", "as_ptr": "*fp32", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32",
         "c_ptr": "*bf16", "tile_expert_ptr": "*i32", "num_tiles_ptr": "*i32", "pair_ptr": "*i32",
         "weight_ptr": "*fp32", **{s: "i32" for s in ("N", "K", "num_progs", *strides)}},
        {"SCATTER": False, "TMA": False, "BLOCK_M": block_m, "BLOCK_N": 128, "BLOCK_K": 128,
         "GROUP_M": 8},
        aligned=("a_ptr", "as_ptr", "w_ptr", "ws_ptr", "c_ptr", "N", "K", *strides),
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    print("grouped W8A8, prefill tiles:", waits(grouped))
    for form in (1, 2):
        kernel = compile_sm90(
            staggered,
            {"a_ptr": "*fp8e4nv", "as_ptr": "*fp32", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32",
             "c_ptr": "*bf16", "K": "i32", "stride_am": "i32", "stride_wn": "i32",
             "stride_as": "i32"},
            {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "FORM": form},
            aligned=("a_ptr", "as_ptr", "w_ptr", "ws_ptr", "c_ptr", "K", "stride_am",
                     "stride_wn"),
            num_warps=8, num_stages=4,
        )  # fmt: skip
        print(f"staggered form {form}:", waits(kernel))


if __name__ == "__main__":
    main()
