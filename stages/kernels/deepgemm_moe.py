"""Routed experts with FP8 weights whose prefill GEMMs run on DeepGEMM's grouped contiguous
kernel (``m_grouped_fp8_gemm_nt_contiguous``, SM90): the moe_experts_fp8 contract of
stages/kernels/triton_moe_fp8.py, and the same bits.

DeepGEMM is built from its source (stages/kernels/deepgemm.py). Where ``deep_gemm`` imports on
an SM90 GPU with a 128-row contiguous alignment (PREFILL_TILES' M tile), "auto" takes this
backend.

A prefill chunk (triton_moe_fp8.tiles_for's prefill tiles) goes through our kernels around
DeepGEMM's two GEMMs: the 1 x 128 quantizer, the routing layout with the rows' scales written
MN-major (what DeepGEMM's SM90 kernels read) and each row's expert (its m_indices), the SwiGLU
quantizer over the live rows (scales MN-major too), and the combine, which reads each pick's
down row where the layout put it (Routing.row_of_pair) and weighs it. DeepGEMM's K loop
promotes each 128-wide block's product to fp32 with the two scales as ours does, and a row's
result does not depend on the other rows of its block, so its gate/up and down rows equal
triton_moe_fp8's bit for bit, and so does the whole step (measured on an H100:
docs/PERFORMANCE.md, sessions 30 and 31); a token's output is the same whichever backend serves
it, alone or batched. A decode batch (fewer rows than the prefill tiles take, CUDA graphs)
stays on the Triton kernels, logged once and counted as a route by design.
"""

from __future__ import annotations

from typing import Any

import torch

from stages.kernels import deepgemm, fp8_ref, triton_fp8_act, triton_moe_fp8
from stages.kernels.fallbacks import record_fallback
from stages.kernels.moe_routing import route_and_gather_scaled
from stages.kernels.triton_moe_combine import combine

BACKEND = "deepgemm"


def is_available(device: str = "cuda") -> bool:
    """deep_gemm imports, the GPU is SM90 (the kernels with fp32 block scales) and its
    contiguous layout aligns M to PREFILL_TILES' 128-row tile."""
    if not triton_moe_fp8.is_available(device) or not deepgemm.sm90_loaded(device):
        return False
    alignment = deepgemm.load().get_mk_alignment_for_contiguous_layout()
    return int(alignment) == triton_moe_fp8.PREFILL_TILES[0]


def moe_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    gu_scale: torch.Tensor,
    down: torch.Tensor,
    d_scale: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    fp8_linear: Any = None,
    limit: float | None = None,
) -> torch.Tensor:
    t, k = topk_ids.shape
    if x.is_cuda and t:  # off CUDA triton_moe_fp8 counts the input; no rows is no work
        declined = _declined(t * k, gate_up)
        if declined is None:
            return _prefill(x, gate_up, gu_scale, down, d_scale, topk_ids, topk_weights, limit)
        record_fallback("moe_experts_fp8", BACKEND, *declined)
    return triton_moe_fp8.moe_experts(
        x, gate_up, gu_scale, down, d_scale, topk_ids, topk_weights, limit=limit
    )


def _declined(pairs: int, gate_up: torch.Tensor) -> tuple[str, str] | None:
    """(reason, detail) where the Triton kernels take this call, else None."""
    experts, width, hidden = gate_up.shape
    if triton_moe_fp8.tiles_for(pairs, experts) != triton_moe_fp8.PREFILL_TILES:
        return "few_rows", f"{pairs} (token, expert) rows: a decode batch -> triton-persistent"
    if hidden % fp8_ref.BLOCK or width % (2 * fp8_ref.BLOCK):
        return "shape", f"experts [{width}, {hidden}] off the 128 grid -> triton-persistent"
    return None


def _prefill(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    gu_scale: torch.Tensor,
    down: torch.Tensor,
    d_scale: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    limit: float | None,
) -> torch.Tensor:
    dg = deepgemm.load()
    block_m = triton_moe_fp8.PREFILL_TILES[0]
    xq, xs = triton_fp8_act.quantize_act(x)
    r, a, a_scale = route_and_gather_scaled(
        xq.view(torch.uint8), xs, topk_ids, topk_weights, gate_up.shape[0], block_m, True
    )
    m_indices = r.expert_of_row
    assert m_indices is not None  # deepgemm=True: the routing kernels wrote it
    rows = a.shape[0]
    h = torch.empty(rows, gate_up.shape[1], dtype=x.dtype, device=x.device)
    dg.m_grouped_fp8_gemm_nt_contiguous(
        (a.view(fp8_ref.FP8), a_scale), (gate_up, gu_scale.float()), h, m_indices
    )
    hq, hs = triton_fp8_act.swiglu_quantize_act(h, limit, group_major=True, live=r.pair_of_row)
    y = torch.empty(rows, down.shape[1], dtype=x.dtype, device=x.device)
    dg.m_grouped_fp8_gemm_nt_contiguous((hq, hs), (down, d_scale.float()), y, m_indices)
    return combine(y, topk_ids, x.dtype, weights=topk_weights, rows=r.row_of_pair)
