"""The Gluon kernels (stages/kernels/gluon_moe_fp8.py, gluon_indexer.py) compile for an
H100/H200 (sm_90) on a machine with no GPU, and do what they are for: each warpgroup MMA (a K
block's, a head's) is issued before the last one is waited for (`wgmma.wait_group 1` in the
loop, where Triton's kernels wait for 0), within the block's shared memory, nothing spilled."""

from __future__ import annotations

import re

import pytest

from tests.cpu.sm90 import compile_gluon_sm90, registers_and_spills

pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")

SM90_SHARED_BYTES = 232_448  # an H100/H200 block's (227 KB)


@pytest.mark.parametrize("block_m", [128, 64])
@pytest.mark.parametrize("scatter", [False, True], ids=["gate_up", "down"])
def test_overlapped_fp8_grouped_gemm_compiles(block_m, scatter):
    from stages.kernels import gluon_hopper, gluon_moe_fp8

    fn = gluon_moe_fp8.kernel()
    a_layout = gluon_hopper.fp8_layout([block_m, 128])
    w_layout = gluon_hopper.fp8_layout([128, 128])
    scalars = ("N", "K", "stride_as", "stride_wse", "stride_wsn", "stride_cm")
    kernel = compile_gluon_sm90(
        fn,
        {
            "a_desc": f"tensordesc<fp8e4nv[{block_m}, 128],{a_layout!r}>",
            "w_desc": f"tensordesc<fp8e4nv[128, 128],{w_layout!r}>",
            "as_ptr": "*fp32",
            "ws_ptr": "*fp32",
            "c_ptr": "*bf16",
            "tile_expert_ptr": "*i32",
            "num_tiles_ptr": "*i32",
            "pair_ptr": "*i32",
            "weight_ptr": "*fp32",
            **{name: "i32" for name in scalars},
        },
        {"SCATTER": scatter, "NUM_STAGES": gluon_moe_fp8.NUM_STAGES, "num_warps": block_m // 16},
        aligned=("as_ptr", "ws_ptr", "c_ptr", "N", "K", "stride_as", "stride_cm"),
        num_warps=block_m // 16,
    )
    ptx = kernel.asm["ptx"]
    assert "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3" in ptx  # Triton's shape
    waits = re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+)", ptx)
    assert sorted(set(waits)) == ["0", "1"]  # 1 in the K loop, 0 after it
    assert "cp.async.bulk.tensor" in ptx  # TMA loads
    assert kernel.metadata.shared <= SM90_SHARED_BYTES, kernel.metadata.shared
    assert registers_and_spills(kernel)[1] == 0


@pytest.mark.parametrize("dim", [128, 64])
def test_overlapped_indexer_chunk_scores_compile(dim):
    """stages/kernels/gluon_indexer.py at V4's index heads (64 x 128) and 64 wide: head h + 1's
    MMA in flight while head h is weighed (`wgmma.wait_group 1`), two warpgroups of 64 tokens x
    64 keys, the queries by TMA, the gathered keys fenced for the MMA, nothing spilled."""
    from stages.kernels import gluon_hopper, gluon_indexer

    layout = gluon_hopper.fp8_layout([gluon_indexer.BLOCK_T, dim])
    ints = ("LMAX", "ENTRIES", "stride_kb", "stride_sb", "stride_wt", "stride_sr", "stride_ot")
    kernel = compile_gluon_sm90(
        gluon_indexer.kernel(),
        {
            "q_desc": f"tensordesc<fp8e4nv[{gluon_indexer.BLOCK_T}, {dim}],{layout!r}>",
            "K": "*fp8e4nv",
            "KS": "*fp32",
            "W": "*fp32",
            "SLOTS": "*i32",
            "VISIBLE": "*i32",
            "TILES": "*i32",
            "OUT": "*fp32",
            **{name: "i32" for name in ints},
        },
        {"HEADS": 64, "BL": gluon_indexer.BLOCK_L, "NUM_STAGES": gluon_indexer.NUM_STAGES,
         "num_warps": gluon_indexer.WARPS},
        aligned=("K", "KS", "W", "SLOTS", "VISIBLE", "OUT", "stride_kb", "stride_wt",
                 "stride_sr", "stride_ot"),
        num_warps=gluon_indexer.WARPS,
    )  # fmt: skip
    ptx = kernel.asm["ptx"]
    assert "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3" in ptx
    assert sorted(set(re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+)", ptx))) == ["0", "1"]
    assert "cp.async.bulk.tensor" in ptx and "fence.proxy.async" in ptx
    assert kernel.metadata.shared <= SM90_SHARED_BYTES, kernel.metadata.shared
    assert registers_and_spills(kernel)[1] == 0
