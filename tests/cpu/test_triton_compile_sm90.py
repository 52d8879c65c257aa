"""The Triton kernels of the MoE, the GEMMs and the indexer compile for an H200 (sm_90) on a
machine with no GPU (triton.compile with an explicit target, the wheel's own ptxas): catches
type and shape errors before device time is spent. Skipped without triton; slow (tens of
seconds). DeepSeek-V4's layer kernels: test_triton_compile_sm90_v4.py; the indexer's top-k:
test_triton_compile_sm90_topk.py."""

from __future__ import annotations

import pytest

from tests.cpu.sm90 import (
    SM90_REGISTERS,
    SM90_SHARED_BYTES,
    SM90_SM_SHARED_BYTES,
    registers_and_spills,
)
from tests.cpu.sm90 import compile_sm90 as _compile

pytestmark = pytest.mark.slow

triton = pytest.importorskip("triton")

SCALARS = {"INTER": "i32", "H": "i32", "num_progs": "i32"}


@pytest.mark.parametrize("flatten,warp_specialize", [(False, False), (True, False), (False, True)])
def test_moe_gemms_compile(flatten, warp_specialize):
    from stages.kernels import triton_moe
    from stages.kernels.moe_tuning import DEFAULT

    bm, g, d = DEFAULT.block_m, DEFAULT.gate, DEFAULT.down
    flags = {"GROUP_M": 8, "FLATTEN": flatten, "WARP_SPECIALIZE": warp_specialize}
    _compile(
        triton_moe._gate_up_silu,
        {
            "a_desc": f"tensordesc<bf16[{bm},{g.block_k}]>",
            "w_desc": f"tensordesc<bf16[1,{g.block_n},{g.block_k}]>",
            "h_desc": f"tensordesc<bf16[{bm},{g.block_n}]>",
            "tile_expert_ptr": "*i32",
            "num_tiles_ptr": "*i32",
            **SCALARS,
        },
        {"BLOCK_M": bm, "BLOCK_N": g.block_n, "BLOCK_K": g.block_k, **flags},
        num_warps=g.num_warps,
        num_stages=g.num_stages,
    )
    _compile(
        triton_moe._down_scatter,
        {
            "h_desc": f"tensordesc<bf16[{bm},{d.block_k}]>",
            "d_desc": f"tensordesc<bf16[1,{d.block_n},{d.block_k}]>",
            "y_ptr": "*bf16",
            "pair_ptr": "*i32",
            "weight_ptr": "*fp32",
            "tile_expert_ptr": "*i32",
            "num_tiles_ptr": "*i32",
            "H": "i32",
            "INTER": "i32",
            "num_progs": "i32",
        },
        {"BLOCK_M": bm, "BLOCK_N": d.block_n, "BLOCK_K": d.block_k, **flags},
        num_warps=d.num_warps,
        num_stages=d.num_stages,
    )


@pytest.mark.parametrize("deepgemm", [False, True], ids=["triton", "deepgemm-operands"])
def test_moe_routing_compiles(deepgemm):
    """The layout's kernels, and with DeepGEMM's operands (each row's expert written too)."""
    from stages.kernels import moe_routing

    _compile(
        moe_routing._count, {"ids_ptr": "*i64", "counts_ptr": "*i32", "N": "i32"}, {"BLOCK": 256}
    )
    plan_args = {
        "tile_start_ptr": "*i32",
        "tile_expert_ptr": "*i32",
        "num_tiles_ptr": "*i32",
        "pair_ptr": "*i32",
        "expert_row_ptr": "*i32",
        "E": "i32",
        "MAX_TILES": "i32",
        "BLOCK_M": "i32",
    }
    _compile(
        moe_routing._plan,
        {"counters_ptr": "*i32", **plan_args},
        {"BLOCK_E": 256, "BLOCK_T": 32, "BLOCK_R": 1024, "EXPERT_ROWS": deepgemm},
    )
    for block_n in (16, 4096):  # a one-row decode step's 7 pairs, a 512-row step's 3,584
        _compile(
            moe_routing._count_plan,
            {"ids_ptr": "*i64", "cursors_ptr": "*i32", "N": "i32", **plan_args},
            {"BLOCK_N": block_n, "BLOCK_E": 512, "BLOCK_T": 32, "BLOCK_R": 1024,
             "EXPERT_ROWS": deepgemm},  # fmt: skip
        )
    for scales in (False, True):  # bf16 rows, or FP8 rows (bytes) with their scales
        _compile(
            moe_routing._scatter,
            {
                "x_ptr": "*u8" if scales else "*bf16",
                "ids_ptr": "*i64",
                "w_ptr": "*bf16",
                "a_ptr": "*u8" if scales else "*bf16",
                "pair_ptr": "*i32",
                "row_weight_ptr": "*fp32",
                "row_of_pair_ptr": "*i32",
                "expert_row_ptr": "*i32",
                "tile_start_ptr": "*i32",
                "fill_ptr": "*i32",
                "scale_ptr": "*fp32",
                "a_scale_ptr": "*fp32",
                "N": "i32",
                "H": "i32",
                "TOPK": "i32",
                "BLOCK_M": "i32",
                "S": "i32",
                "stride_asr": "i32",
                "stride_ass": "i32",
            },
            {"BLOCK_P": 16, "BLOCK_H": 256, "SCALES": scales, "BLOCK_S": 32,
             "EXPERT_ROWS": deepgemm and scales},  # fmt: skip
        )


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-keys", "fp8-keys"])
def test_indexer_rows_kernels_compile(fp8):
    from stages.kernels import triton_indexer
    from stages.kernels.indexer_select import MAXIMA_GROUP

    chunk, decode = triton_indexer._rows_kernels()
    strides = ("stride_qt", "stride_qh", "stride_kb", "stride_sb", "stride_wt", "stride_sr")
    sig = {
        "Q": "*fp8e4nv" if fp8 else "*bf16",  # FP8 keys: FP8 queries (FP8 MMA)
        "K": "*fp8e4nv" if fp8 else "*bf16",
        "KS": "*fp32" if fp8 else "*bf16",
        "W": "*fp32",
        "SLOTS": "*i32",
        "VISIBLE": "*i32",
        "TILES": "*i32",
        "OUT": "*fp32",
        "M": "*fp32",
        "LMAX": "i32",
        "ENTRIES": "i32",
        **{s: "i32" for s in (*strides, "stride_ot", "stride_m")},
    }
    # with the group maxima the top-k reads (the model's calls write them)
    shape = {"HEADS": 64, "HEAD_DIM": 128, "KEY_FP8": fp8, "GROUP": MAXIMA_GROUP}
    cfg = triton_indexer.CHUNK_CONFIG_FP8 if fp8 else triton_indexer.CHUNK_CONFIG
    chunk_shape = {**shape, "BT": 64, "BL": cfg.block_l}
    aligned = tuple(a for a, t in sig.items() if t.startswith("*") or a.startswith("stride"))
    kernel = _compile(
        chunk, sig, chunk_shape, aligned, num_warps=cfg.warps, num_stages=cfg.stages,
        maxnreg=cfg.maxnreg,
    )  # fmt: skip
    if fp8:  # the register cap's point: three programs an SM (ptxas alone takes 239: two)
        registers, _ = registers_and_spills(kernel)
        warp_registers = -(-registers * 32 // 256) * 256
        assert 3 * cfg.warps * warp_registers <= SM90_REGISTERS, registers
        assert 3 * (kernel.metadata.shared + 1024) <= SM90_SM_SHARED_BYTES
    dec = triton_indexer.DECODE_CONFIG
    _compile(decode, sig, {**shape, "BL": dec.block_l}, num_warps=dec.warps)


def test_query_quantizer_compiles():
    from stages.kernels import fp8_latent, triton_indexer

    sig = {"Q": "*bf16", "W": "*bf16", "QOUT": "*fp8e4nv", "WOUT": "*fp32", "T": "i32"}
    sig |= {"scale": "fp32", "stride_qt": "i32", "stride_qh": "i32", "stride_wt": "i32"}
    shape = {"HEADS": 64, "HEAD_DIM": 128, "TOKENS": triton_indexer.QUANTIZE_TOKENS}
    _compile(triton_indexer._quantize_kernel(), sig, {**shape, "FP8_MAX": fp8_latent.FP8_MAX})


@pytest.mark.parametrize("dim", [128, 64, 100])
def test_fp8_indexer_key_write_compiles(dim):
    from stages.kernels import fp8_latent, triton_fp8_latent

    _compile(
        triton_fp8_latent._quantize_write_key,
        {
            "k_ptr": "*bf16",
            "slot_ptr": "*i64",
            "values_ptr": "*fp8e4nv",
            "scales_ptr": "*fp32",
            "stride_k": "i32",
            "stride_vb": "i32",
            "stride_sb": "i32",
            "entries": "i32",
        },
        {"DIM": dim, "BLOCK": triton.next_power_of_2(dim), "FP8_MAX": fp8_latent.FP8_MAX},
        num_warps=1,
    )


@pytest.mark.parametrize("scaled", [False, True], ids=["bf16", "w8a8"])
def test_pointer_gemm_compiles_in_both_modes(scaled):
    """triton_gemm's pointer kernel: bf16, and block-scaled FP8 (fp8_gemm's W8A8 linear)."""
    from stages.kernels import fp8_gemm, triton_gemm

    operand = "*fp8e4nv" if scaled else "*bf16"
    cfg = fp8_gemm.TILES if scaled else triton_gemm.DEFAULT_MEDIUM
    ints = ("M", "N", "K", "num_progs", "stride_am", "stride_wn", "stride_cm")
    _compile(
        triton_gemm._gemm_ptr,
        {
            "a_ptr": operand,
            "w_ptr": operand,
            "c_ptr": "*bf16",
            "bias_ptr": "*bf16",
            "as_ptr": "*fp32" if scaled else "*bf16",
            "ws_ptr": "*fp32" if scaled else "*bf16",
            **{s: "i32" for s in (*ints, "stride_as", "stride_ws")},
        },
        {
            "HAS_BIAS": True,
            "BLOCK_SCALED": scaled,
            "BLOCK_M": cfg.block_m,
            "BLOCK_N": cfg.block_n,
            "BLOCK_K": cfg.block_k,
            "GROUP_M": cfg.group_m,
        },
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )


@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
@pytest.mark.parametrize("tiles", ["DECODE_TILES", "PREFILL_TILES"])
@pytest.mark.parametrize("scatter", [False, True], ids=["gate_up", "down"])
def test_fp8_grouped_gemm_compiles(scatter, tiles, tma):
    """The grouped W8A8 GEMM at both tile configurations, its tiles through pointer loads or
    TMA descriptors: pipelined, within the block's shared memory, no register spilled (on
    pointer loads 202-232 registers a thread, through TMA 164-178); at the prefill tiles through
    TMA, PREFILL_PROGRAMS_PER_SM programs fit one SM's registers and shared memory together."""
    from stages.kernels import triton_moe_fp8

    block_m, warps, stages = getattr(triton_moe_fp8, tiles)
    strides = ("stride_am", "stride_as", "stride_we", "stride_wn", "stride_wse", "stride_wsn",
               "stride_cm")  # fmt: skip
    kernel = _compile(
        triton_moe_fp8._grouped_w8a8,
        {
            "a_ptr": f"tensordesc<fp8e4nv[{block_m},128]>" if tma else "*fp8e4nv",
            "as_ptr": "*fp32",
            "w_ptr": "tensordesc<fp8e4nv[1,128,128]>" if tma else "*fp8e4nv",
            "ws_ptr": "*fp32",
            "c_ptr": "*bf16",
            "tile_expert_ptr": "*i32",
            "num_tiles_ptr": "*i32",
            "pair_ptr": "*i32",
            **{s: "i32" for s in ("N", "K", "num_progs", *strides)},
        },
        {
            "SCATTER": scatter,
            "TMA": tma,
            "BLOCK_M": block_m,
            "BLOCK_N": 128,
            "BLOCK_K": 128,
            "GROUP_M": 8,
        },
        # as the launcher specializes them (the descriptors carry their own alignment)
        aligned=tuple(
            a
            for a in ("a_ptr", "as_ptr", "w_ptr", "ws_ptr", "c_ptr", "N", "K", *strides)
            if not (tma and a in ("a_ptr", "w_ptr"))
        ),
        num_warps=warps,
        num_stages=stages,
    )
    # pipelined (cp.async or TMA loads, num_stages of tiles in shared memory), nothing spilled
    ptx = kernel.asm["ptx"]
    assert ("cp.async.bulk.tensor" in ptx) == tma and ("cp.async.cg" in ptx) != tma
    assert kernel.metadata.shared <= SM90_SHARED_BYTES, kernel.metadata.shared
    registers, spilled = registers_and_spills(kernel)
    assert spilled == 0
    if tiles == "PREFILL_TILES" and tma:  # its programs an SM resident together (their point;
        # the pointer loads' 230 registers fit two: that path is only for operands TMA refuses)
        per_sm = triton_moe_fp8.PREFILL_PROGRAMS_PER_SM
        warp_registers = -(-registers * 32 // 256) * 256  # allocated per warp in 256s
        assert per_sm * warps * warp_registers <= SM90_REGISTERS, (registers, per_sm)
        assert per_sm * (kernel.metadata.shared + 1024) <= SM90_SM_SHARED_BYTES


def test_fp8_gate_up_swiglu_compiles_without_spilling():
    """The grouped gate/up GEMM with the SwiGLU and quantizer in its epilogue, gate's and up's
    columns in one product a K step, at its launch (SWIGLU_LAUNCH: 8 warps over the decode
    tiles' [64, 256]): pipelined, within the block's shared memory, nothing spilled (at 4 warps
    it spilled over 500 bytes; gate then up on 4 warps spilled 44), IEEE division in the
    quantizer."""
    from stages.kernels import fp8_ref, triton_moe_fp8

    warps, stages = triton_moe_fp8.SWIGLU_LAUNCH
    strides = ("stride_am", "stride_as", "stride_we", "stride_wn", "stride_wse", "stride_wsn")
    kernel = _compile(
        triton_moe_fp8._grouped_w8a8_swiglu,
        {
            **{p: "*fp8e4nv" for p in ("a_ptr", "w_ptr", "q_ptr")},
            **{p: "*fp32" for p in ("as_ptr", "ws_ptr", "qs_ptr")},
            **{p: "*i32" for p in ("tile_expert_ptr", "num_tiles_ptr", "pair_ptr")},
            **{s: "i32" for s in ("INTER", "K", "num_progs", *strides, "stride_qm", "stride_qsm")},
            "limit": "fp32",
        },
        {
            "HAS_LIMIT": True, "CUDA_EXP": True, "H_DTYPE": triton.language.bfloat16,
            "INV_FP8_MAX": 1 / fp8_ref.FP8_MAX, "MIN_SCALE": fp8_ref.MIN_SCALE,
            "BLOCK_M": triton_moe_fp8.DECODE_TILES[0], "BLOCK_N": 128, "BLOCK_K": 128,
            "GROUP_M": 8,
        },
        # as the launcher sees V4-Flash's buffers, so the pipeline's stages are in shared memory
        aligned=("a_ptr", "as_ptr", "w_ptr", "ws_ptr", "q_ptr", "INTER", "K", "stride_am",
                 "stride_we", "stride_wn", "stride_qm"),
        num_warps=warps,
        num_stages=stages,
    )  # fmt: skip
    assert "cp.async" in kernel.asm["ptx"]  # the loads pipelined
    assert kernel.metadata.shared <= SM90_SHARED_BYTES, kernel.metadata.shared
    assert registers_and_spills(kernel)[1] == 0
    assert "div.rn.f32" in kernel.asm["ptx"]


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_fp8_activation_quantizer_compiles_with_ieee_division(dtype):
    """triton_fp8_act's kernel; its divisions are IEEE-rounded (div.rn: fp8_ref's bits), not
    Triton's default approximate float32 division, and its e4m3 cast rounds to nearest."""
    from stages.kernels import fp8_ref, triton_fp8_act

    ints = ("M", "R", "K", "stride_xm", "stride_qm", "stride_sm", "stride_sg")
    compiled = _compile(
        triton_fp8_act._quantize_1x128,
        {"x_ptr": f"*{dtype}", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", **dict.fromkeys(ints, "i32")},
        {
            "INV_FP8_MAX": 1 / fp8_ref.FP8_MAX,
            "MIN_SCALE": fp8_ref.MIN_SCALE,
            "BLOCK_M": triton_fp8_act.LAUNCH[0],
            "GROUP": fp8_ref.BLOCK,
        },
        num_warps=triton_fp8_act.LAUNCH[1],
    )
    ptx = compiled.asm["ptx"]
    assert "div.rn.f32" in ptx and "div.full.f32" not in ptx and "div.approx" not in ptx
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx
    for live in (False, True):  # the grouped MoE's unfused path reads only its live rows
        compiled = _compile(
            triton_fp8_act._swiglu_quantize_1x128,
            {
                "x_ptr": f"*{dtype}",
                "q_ptr": "*fp8e4nv",
                "s_ptr": "*fp32",
                "live_ptr": "*i32",
                **dict.fromkeys(ints, "i32"),
                "limit": "fp32",
            },
            {
                "HAS_LIMIT": True,
                "HAS_LIVE": live,
                "CUDA_EXP": True,
                "INV_FP8_MAX": 1 / fp8_ref.FP8_MAX,
                "MIN_SCALE": fp8_ref.MIN_SCALE,
                "BLOCK_M": triton_fp8_act.SWIGLU_LAUNCH[0],
                "GROUP": fp8_ref.BLOCK,
            },
            num_warps=triton_fp8_act.SWIGLU_LAUNCH[1],
        )
        ptx = compiled.asm["ptx"]  # IEEE divisions, the silu's too (torch's silu divides so)
        assert "div.rn.f32" in ptx and "div.full.f32" not in ptx and "div.approx" not in ptx


@pytest.mark.parametrize("dot_scaled", [True, False], ids=["dot-scaled", "own-dequant"])
@pytest.mark.parametrize("swiglu", [True, False], ids=["gate-up", "down"])
@pytest.mark.parametrize("tiles", ["DECODE_TILES", "MID_TILES", "PREFILL_TILES"])
def test_mxfp4_moe_gemm_compiles(swiglu, tiles, dot_scaled):
    """The W4A16 grouped GEMM over packed MXFP4 experts (e2m1 upcast with the e8m0 scales, bf16
    MMA) at each of its tile configurations, on both paths, with no register spilled (at 4
    warps the 64-row tiles spilled up to 340 bytes with their gate and up side by side)."""
    from stages.kernels import triton_moe_mxfp4

    t = getattr(triton_moe_mxfp4, tiles)
    strides = ("stride_am", "stride_we", "stride_wn", "stride_se", "stride_sn", "stride_cm")
    kernel = _compile(
        triton_moe_mxfp4._grouped_w4a16,
        {
            "a_ptr": "*bf16",
            "w_ptr": "*u8",
            "ws_ptr": "*u8",
            "c_ptr": "*bf16",
            "tile_expert_ptr": "*i32",
            "num_tiles_ptr": "*i32",
            "pair_ptr": "*i32",
            "weight_ptr": "*fp32",
            **{s: "i32" for s in ("N", "K", "num_progs", *strides)},
            "LIMIT": "fp32",
        },
        {
            "SWIGLU": swiglu,
            "HAS_LIMIT": swiglu,
            "BF16": True,
            "DOT_SCALED": dot_scaled,
            "A_FORMAT": "bf16",
            "BLOCK_M": t.block_m,
            "BLOCK_N": t.block_n,
            "BLOCK_K": t.block_k,
            "GROUP_M": t.group_m,
        },
        # V4's buffers as the launcher sees them: 16-byte aligned, widths multiples of 16
        aligned=("a_ptr", "w_ptr", "ws_ptr", "c_ptr", "N", "K", *strides),
        num_warps=t.num_warps,
        num_stages=t.num_stages,
    )
    assert registers_and_spills(kernel)[1] == 0


@pytest.mark.parametrize("weighted,by_row", [(False, False), (True, False), (True, True)])
def test_moe_combine_compiles(weighted, by_row):
    """The combine as each grouped MoE calls it: rows pre-weighted at their pairs (bf16,
    MXFP4), weighted here (FP8), read where DeepGEMM's GEMM left them (by row)."""
    from stages.kernels import triton_moe_combine as c

    _compile(
        c._combine,
        {
            "y_ptr": "*bf16",
            "ids_ptr": "*i64",
            "out_ptr": "*bf16",
            "w_ptr": "*fp32",
            "row_ptr": "*i32",
            **{name: "i32" for name in ("T", "H", "stride_y", "stride_ids", "stride_out")},
        },
        {"K": 6, "WEIGHTED": weighted, "BY_ROW": by_row, "BLOCK_T": c.BLOCK_T,
         "BLOCK_H": c.BLOCK_H},  # fmt: skip
        num_warps=4,
    )
