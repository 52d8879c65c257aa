"""The indexer's top-k kernels (stages/kernels/triton_topk.py's maxima pass and compaction,
stages/kernels/triton_rule_topk.py's one-program pick) compile for an H200 (sm_90) on a machine
with no GPU, as test_triton_compile_sm90.py's. Skipped without triton; slow."""

from __future__ import annotations

import pytest

from tests.cpu.sm90 import compile_sm90 as _compile
from tests.cpu.sm90 import registers_and_spills

pytestmark = pytest.mark.slow

triton = pytest.importorskip("triton")


@pytest.mark.parametrize("groups,find_theta", [(8192, False), (8192, True), (32768, True)])
@pytest.mark.parametrize("gather", [None, 32], ids=["by-step", "gather"])
def test_topk_compaction_compiles(groups, find_theta, gather):
    from stages.kernels import triton_topk

    # theta read, or found with the maxima in registers, or walked
    select = {"FIND_THETA": find_theta, **triton_topk._select_launch(groups)}
    sig = {"S": "*fp32", "M": "*fp32", "THETA": "*fp32", "VAL": "*fp32", "POS": "*i64",
           "TAKEN": "*i32", "LIVE": "*i32"}  # fmt: skip
    _compile(
        triton_topk.compact_kernel,
        {**sig, "L": "i32", "G": "i32", "K": "i32", "stride_s": "i64", "stride_m": "i64",
         "stride_c": "i64"},
        {"GROUP": triton_topk.GROUP, "BLOCK_G": triton_topk.COMPACT[0], **select,
         "GATHER": bool(gather), "GATHER_G": gather or 1},
        num_warps=triton_topk.COMPACT[1],
    )
    _compile(
        triton_topk.maxima_kernel,
        {"S": "*fp32", "M": "*fp32", "L": "i32", "G": "i32", "stride_s": "i64", "stride_m": "i64"},
        {"GROUP": triton_topk.GROUP, "BLOCK": triton_topk.BLOCK},
        num_warps=4,
    )


@pytest.mark.parametrize(
    "width,k,lengths",
    [(576, 512, False), (4608, 512, False), (64, 37, False), (2048, 512, True), (4608, 512, True)],
)
@pytest.mark.parametrize("sort", [True, False], ids=["sorted", "ranked"])
def test_rule_topk_compiles(width, k, lengths, sort):
    """The rule's top-k in one program at a decode step's short CSA line, the compaction's
    candidates of a long one (the widest block, 16 warps) and a small line, its step 3 a sort
    or counted ranks, and over the candidates' live prefixes (PREFIX_BLOCK's launch and the
    whole lines'): nothing spilled."""
    from stages.kernels import triton_rule_topk as r

    block, k_pow2 = r.launch_shape(width, k)
    kernel = _compile(
        r._rule_top_k,
        {"S": "*fp32", "OUT": "*i64", "KEPT": "*i64", "LENGTHS": "*i32", "W": "i32", "K": "i32",
         "LOW": "i32", "HIGH": "i32", "stride_s": "i32", "stride_o": "i32", "stride_k": "i32"},
        {"BLOCK": block, "K_POW2": k_pow2, "CHUNK": r.CHUNK, "SORT": sort,
         "HAS_LENGTHS": lengths},
        num_warps=r.warps_for(block),
    )  # fmt: skip
    assert registers_and_spills(kernel)[1] == 0  # a CHUNK of 64 spilled ~400 bytes
