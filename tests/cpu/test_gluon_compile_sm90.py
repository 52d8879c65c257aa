"""The Gluon grouped W8A8 GEMM (stages/kernels/gluon_moe_fp8.py) compiles for an H100/H200
(sm_90) on a machine with no GPU, and does what it is for: each K block's warpgroup MMA is
issued before the last one is waited for (`wgmma.wait_group 1` in the loop, where Triton's
kernel waits for 0), within the block's shared memory, nothing spilled."""

from __future__ import annotations

import re

import pytest

from tests.cpu.sm90 import compile_gluon_sm90, registers_and_spills

pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")

SM90_SHARED_BYTES = 232_448  # an H100/H200 block's (227 KB)


@pytest.mark.parametrize("block_m", [128, 64])
@pytest.mark.parametrize("scatter", [False, True], ids=["gate_up", "down"])
def test_overlapped_fp8_grouped_gemm_compiles(block_m, scatter):
    from stages.kernels import gluon_moe_fp8

    fn = gluon_moe_fp8.kernel()
    a_layout = gluon_moe_fp8.descriptor_layout([block_m, 128])
    w_layout = gluon_moe_fp8.descriptor_layout([128, 128])
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
