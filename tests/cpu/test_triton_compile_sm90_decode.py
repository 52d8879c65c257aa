"""A decode step's FP8 kernels with the weights' rows as the MMA's wide side (the W8A8 decode
linear, the routed experts' swapped gate/up and down) compile for an H200 (sm_90) on a machine
with no GPU, as test_triton_compile_sm90.py's: Hopper's warpgroup MMA on e4m3 (the Triton
GEMMs' instruction, so their bits), the K steps in flight, PDL's wait, no register spilled.
Skipped without triton; slow."""

from __future__ import annotations

import pytest

from tests.cpu.sm90 import SM90_SHARED_BYTES, registers_and_spills
from tests.cpu.sm90 import compile_sm90 as _compile

pytestmark = pytest.mark.slow

triton = pytest.importorskip("triton")


@pytest.mark.parametrize("block_x", [16, 32])
def test_fp8_decode_linear_compiles_to_pipelined_wgmma(block_x):
    """The W8A8 decode linear: the weights' and the quantized rows' K steps in flight (cp.async)
    into Hopper's warpgroup MMA (the Triton GEMMs' instruction, so their bits), PDL's wait, no
    register spilled."""
    from stages.kernels import triton_fp8_decode_linear as d

    ints = ("M", "N", "K", "stride_xm", "stride_xsm", "stride_wn", "stride_wsn", "stride_om")
    kernel = _compile(
        d._swap_ab_w8a8,
        {"X": "*fp8e4nv", "XS": "*fp32", "W": "*fp8e4nv", "WS": "*fp32", "BIAS": "*bf16",
         "OUT": "*bf16", **dict.fromkeys(ints, "i32")},
        {"HAS_BIAS": False, "BLOCK_X": block_x, "BLOCK_W": d.BLOCK_W, "BLOCK_K": 128,
         "STAGES": d.STAGES, "PDL": True},
        aligned=("X", "W", "WS", "OUT", "N", "K", "stride_xm", "stride_wn", "stride_om"),
        num_warps=d.WARPS,
    )  # fmt: skip
    ptx = kernel.asm["ptx"]
    assert "wgmma.mma_async" in ptx and "e4m3" in ptx and "mma.sync" not in ptx
    assert "cp.async" in ptx and "griddepcontrol.wait" in ptx
    assert kernel.metadata.shared <= SM90_SHARED_BYTES, kernel.metadata.shared
    assert registers_and_spills(kernel)[1] == 0


def test_fp8_moe_swapped_gate_up_compiles_to_pipelined_wgmma():
    """The decode experts' gate/up with the weight rows as the MMA's wide side, its 128-wide
    groups quantized in the epilogue."""
    from stages.kernels import fp8_ref
    from stages.kernels import triton_moe_fp8_decode as d

    warps, stages = d.GATE_UP_LAUNCH
    strides = ("stride_am", "stride_as", "stride_we", "stride_wn", "stride_wse", "stride_wsn")
    kernel = _compile(
        d._swapped_gate_up,
        {
            **{p: "*fp8e4nv" for p in ("a_ptr", "w_ptr", "q_ptr")},
            **{p: "*fp32" for p in ("as_ptr", "ws_ptr", "qs_ptr")},
            **{p: "*i32" for p in ("tile_expert_ptr", "num_tiles_ptr", "pair_ptr")},
            **{s: "i32" for s in ("INTER", "K", *strides, "stride_qm", "stride_qsm")},
            "limit": "fp32",
        },
        {
            "HAS_LIMIT": True, "CUDA_EXP": True, "H_DTYPE": triton.language.bfloat16,
            "INV_FP8_MAX": 1 / fp8_ref.FP8_MAX, "MIN_SCALE": fp8_ref.MIN_SCALE,
            "BLOCK_X": d.DECODE_BLOCK_M, "BLOCK_N": 128, "BLOCK_K": 128, "STAGES": stages,
            "PDL": True,
        },
        aligned=("a_ptr", "as_ptr", "w_ptr", "ws_ptr", "q_ptr", "INTER", "K", "stride_am",
                 "stride_we", "stride_wn", "stride_qm"),
        num_warps=warps,
    )  # fmt: skip
    ptx = kernel.asm["ptx"]
    assert "wgmma.mma_async" in ptx and "cp.async" in ptx and "griddepcontrol.wait" in ptx
    assert kernel.metadata.shared <= SM90_SHARED_BYTES, kernel.metadata.shared
    assert registers_and_spills(kernel)[1] == 0


def test_fp8_moe_swapped_down_compiles_to_pipelined_wgmma():
    from stages.kernels import triton_moe_fp8_decode as d

    warps, stages = d.DOWN_LAUNCH
    strides = ("stride_am", "stride_as", "stride_we", "stride_wn", "stride_wse", "stride_wsn")
    kernel = _compile(
        d._swapped_down,
        {
            "a_ptr": "*fp8e4nv", "w_ptr": "*fp8e4nv", "c_ptr": "*bf16", "as_ptr": "*fp32",
            "ws_ptr": "*fp32",
            **{p: "*i32" for p in ("tile_expert_ptr", "num_tiles_ptr", "pair_ptr")},
            **{s: "i32" for s in ("N", "K", *strides, "stride_cm")},
        },
        {
            "BLOCK_X": d.DECODE_BLOCK_M, "BLOCK_W": d.BLOCK_W, "BLOCK_K": 128, "STAGES": stages,
            "PDL": True,
        },
        aligned=("a_ptr", "as_ptr", "w_ptr", "ws_ptr", "c_ptr", "N", "K", "stride_am",
                 "stride_we", "stride_wn", "stride_cm"),
        num_warps=warps,
    )  # fmt: skip
    ptx = kernel.asm["ptx"]
    assert "wgmma.mma_async" in ptx and "cp.async" in ptx
    assert registers_and_spills(kernel)[1] == 0
