"""DeepSeek-V4's layer kernels (hyper-connections, rope and its angles, the fp32-weight norm,
the compressor's group pooling, the router, a decode step's index arithmetic) compile for an
H200 (sm_90) on a machine with no GPU, as test_triton_compile_sm90.py's. Skipped without
triton; slow."""

from __future__ import annotations

import itertools

import pytest

from tests.cpu.sm90 import compile_sm90 as _compile

pytestmark = pytest.mark.slow

triton = pytest.importorskip("triton")


@pytest.mark.parametrize("precision", ["ieee", "bf16x3"])
def test_hyper_connection_kernels_compile(precision):
    from stages.kernels import triton_hyper as th

    n, bt, bd = 4, th.BLOCK_T, th.BLOCK_D
    _compile(
        th._project,
        {"x_ptr": "*bf16", "w_ptr": "*fp32", "part_ptr": "*fp32", "sq_ptr": "*fp32", "T": "i32",
         "K": "i32", "M": "i32", "K_PER_SPLIT": "i32"},
        {"BLOCK_T": bt, "BLOCK_K": th.BLOCK_K, "BLOCK_M": 32, "PRECISION": precision},
        num_warps=4,
    )  # fmt: skip
    # the block's input norm folded in or not; V4-Flash's whole row a tile, or wider rows
    for norm, (tile_t, tile_d, warps) in itertools.product(
        (False, True), (th.finish_tile(1, n, 4096), (bt, bd, 4))
    ):
        kernel = _compile(
            th._finish,
            {"part_ptr": "*fp32", "sq_ptr": "*fp32", "base_ptr": "*fp32", "scale_ptr": "*fp32",
             "x_ptr": "*bf16", "post_ptr": "*fp32", "comb_ptr": "*fp32", "out_ptr": "*bf16",
             "w_ptr": "*fp32", "T": "i32", "D": "i32", "SPLIT": "i32", "iters": "i32",
             "eps": "fp32", "norm_eps": "fp32", "inv_d": "fp32", "out_eps": "fp32"},
            {"N": n, "NORM": norm, "CUDA_RSQRT": True, "BLOCK_T": tile_t, "BLOCK_D": tile_d,
             "SPLIT_BLOCK": 64 // tile_t},
            num_warps=warps,
        )  # fmt: skip
        if tile_t == 1:
            # the comb's partial sums summed as [S, T, N * N] leave the Sinkhorn's [T, N, N]
            # within a warp: no barrier in its loop (31 barriers in all, three an iteration,
            # when they were summed as [S, T, N, N] and its reductions crossed warps)
            assert kernel.asm["ptx"].count("bar.sync") <= 24
    _compile(
        th._merge,
        {"x_ptr": "*bf16", "o_ptr": "*bf16", "post_ptr": "*fp32", "comb_ptr": "*fp32",
         "y_ptr": "*bf16", "T": "i32", "D": "i32"},
        {"N": n, "BLOCK_T": bt, "BLOCK_D": bd},
        num_warps=4,
    )  # fmt: skip


@pytest.mark.parametrize("norm,weighted", [(True, False), (True, True), (False, False)])
def test_rope_tail_compiles(norm, weighted):
    from stages.kernels import triton_rope

    ints = ("H", "D", "stride_t", "stride_h", "stride_c", "stride_s")
    _compile(
        triton_rope._rope_tail,
        {
            "x_ptr": "*bf16",
            "cos_ptr": "*fp32",
            "sin_ptr": "*fp32",
            "w_ptr": "*fp32",
            **{name: "i32" for name in ints},
            "inv_d": "fp32",
            "eps": "fp32",
        },
        {
            "R": 64,
            "NORM": norm,
            "WEIGHTED": weighted,
            "CUDA_RSQRT": True,
            "BLOCK_H": 4 if norm else 8,
            "BLOCK_D": 512,
        },
        num_warps=4,
        enable_fp_fusion=False,
    )


def test_rms_norm_fp32_compiles():
    from stages.kernels import triton_rope

    _compile(
        triton_rope._rms_norm,
        {
            "x_ptr": "*bf16",
            "w_ptr": "*fp32",
            "out_ptr": "*bf16",
            **{name: "i32" for name in ("N", "D", "stride_x", "stride_o")},
            "inv_d": "fp32",
            "eps": "fp32",
        },
        {"CUDA_RSQRT": True, "BLOCK_R": triton_rope.NORM_ROWS, "BLOCK_D": 4096},
        num_warps=8,
        enable_fp_fusion=False,
    )


@pytest.mark.parametrize(
    "rate,overlap,live", [(4, True, False), (4, True, True), (128, False, True)]
)
def test_group_pool_compiles(rate, overlap, live):
    from stages.kernels import triton_group_pool

    block_s = 2 * rate if overlap else rate
    _compile(
        triton_group_pool._pool_groups,
        {
            "in_ptr": "*bf16",
            "slot_ptr": "*i64",
            "first_ptr": "*i1",
            "live_ptr": "*i1",
            "bias_ptr": "*fp32",
            "out_ptr": "*bf16",
            **{
                name: "i32"
                for name in ("W", "stride_in", "stride_slot", "stride_bias", "stride_out")
            },
        },
        {
            "RATE": rate,
            "OVERLAP": overlap,
            "LIVE": live,
            "CUDA_EXP": True,
            "BLOCK_S": block_s,
            "BLOCK_W": min(512, triton_group_pool.TILE_ELEMENTS // block_s),
        },
        num_warps=4,
        enable_fp_fusion=False,
    )


@pytest.mark.parametrize("pick,sqrtsoftplus", [(True, True), (False, True), (True, False)])
@pytest.mark.parametrize("extra", [False, True])
def test_route_topk_compiles(pick, sqrtsoftplus, extra):
    from stages.kernels import triton_route_topk as r

    strides = ("T", "E", "stride_l", "stride_g", "stride_i", "stride_w", "extra")
    _compile(
        r._route_topk,
        {
            "logit_ptr": "*bf16",
            "bias_ptr": "*fp32",
            "given_ptr": "*i64",
            "ids_ptr": "*i64",
            "w_ptr": "*bf16",
            **{name: "i32" for name in strides},
            "scale": "fp32",
        },
        {
            "K": 6,
            "SQRTSOFTPLUS": sqrtsoftplus,
            "PICK": pick,
            "COPY": extra and not pick,
            "EXTRA": extra,
            "CUDA_MATH": True,
            "BLOCK_T": r.BLOCK_T,
            "BLOCK_E": 256,
            "K_POW2": 8,
        },
        num_warps=4,
        enable_fp_fusion=False,
    )


@pytest.mark.parametrize("rate,dense", [(4, False), (128, True)])
def test_v4_paged_index_compiles(rate, dense):
    from stages.kernels import triton_v4_paged_index as k

    ints = {"pos_ptr": "*i64", "len_ptr": "*i64", "trow_ptr": "*i64", "tab_ptr": "*i32"}
    scalars = {name: "i32" for name in ("stride_tab", "max_cols", "BS", "W")}
    _compile(
        k._window_index,
        {**ints, "idx_ptr": "*i32", "slot_ptr": "*i64", **scalars},
        {"BLOCK_W": 128},
        num_warps=1,
    )
    outs = {
        "table_ptr": "*i64", "table32_ptr": "*i32", "visible_ptr": "*i64", "base_ptr": "*i64",
        "input_ptr": "*i64", "first_ptr": "*i1", "gpos_ptr": "*i64", "entry_ptr": "*i64",
        "completes_ptr": "*i1", "dense_ptr": "*i32",
    }  # fmt: skip
    more = {name: "i32" for name in ("N", "MOST", "scratch_entry")}
    _compile(
        k._rate_index,
        {**ints, **outs, **scalars, **more},
        {"RATE": rate, "DENSE": dense, "BLOCK_M": k.ENTRIES_A_STEP, "BLOCK_G": 2 * rate,
         "BLOCK_W": 128},  # fmt: skip
        num_warps=4,
    )
    _compile(
        k._pick_slots,
        {"pick_ptr": "*i64", "table_ptr": "*i64", "visible_ptr": "*i64", "out_ptr": "*i32",
         "count_ptr": "*i32",
         **{name: "i32" for name in ("K", "stride_p", "stride_t", "stride_o")}},  # fmt: skip
        {"BLOCK_K": 512},
        num_warps=4,
    )


def test_rope_angles_compiles():
    from stages.kernels import triton_rope

    _compile(
        triton_rope._rope_angles,
        {"pos_ptr": "*i64", "inv_ptr": "*fp32", "cos_ptr": "*fp32", "sin_ptr": "*fp32",
         "N": "i32", "HALF": "i32", "scaling": "fp32"},
        {"ROUND_BF16": True, "ROUND_F16": False, "CUDA_MATH": True,
         "BLOCK_N": triton_rope.ANGLE_ROWS, "BLOCK_H": 32},
        num_warps=1,
        enable_fp_fusion=False,
    )  # fmt: skip


def test_fp8_latent_write_with_rows_compiles():
    """The V4 FP8 latent's write with the token's compressor inputs copied beside it (a CSA
    layer's comp_in and index_in at V4-Flash's widths): each copy adds its stores."""
    from stages.kernels import fp8_latent, fp8_v4_layout, triton_fp8_latent

    pointers = ("v_ptr", "q_ptr", "byte_ptr", "rope_ptr", "dst_0", "src_0", "dst_1", "src_1")
    types = {"v_ptr": "*bf16", "slot_ptr": "*i64", "q_ptr": "*fp8e4nv", "byte_ptr": "*u8",
             "rope_ptr": "*bf16", "dst_0": "*bf16", "src_0": "*bf16", "dst_1": "*bf16",
             "src_1": "*bf16"}  # fmt: skip
    scalars = ("stride_v", "block_stride", "entries", "stride_0", "width_0", "stride_1", "width_1")
    stores = []
    for copies in (0, 1, 2):
        kernel = _compile(
            triton_fp8_latent._quantize_write_v4,
            {**types, **{name: "i32" for name in scalars}},
            {"NOPE": fp8_v4_layout.NOPE, "ROPE": fp8_v4_layout.ROPE, "TILE": fp8_v4_layout.TILE,
             "FP8_MAX": fp8_latent.FP8_MAX, "COPIES": copies, "BLOCK_0": 2048, "BLOCK_1": 512,
             "PDL": True},
            aligned=(*pointers, "stride_v", "stride_0", "width_0", "stride_1", "width_1"),
            num_warps=4,
        )  # fmt: skip
        stores.append(kernel.asm["ptx"].count("st.global"))
    assert stores[0] < stores[1] < stores[2], stores
