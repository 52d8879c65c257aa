"""The deepgemm indexer_logits_rows backend (stages/kernels/deepgemm_indexer.py: DeepGEMM's
``fp8_mqa_logits``, built from its source: .gpu-deepgemm/) beside the Triton kernels on
app.bench.indexer_select's cases over FP8 keys, both writing the group maxima as the models
call them: the time of each, DeepGEMM's kernel alone, TFLOP/s, how far the backends' scores
are apart, and whether the rule's top-k picks the same keys from both.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from app.bench.indexer_select import DIM, PAGE_ENTRIES, _case
from app.bench.moe import timed
from stages.kernels import (
    deepgemm,
    deepgemm_indexer,
    fp8_indexer,
    indexer_select,
    triton_indexer,
    triton_topk,
)
from stages.kernels.indexer_select import topk_slots


def deepgemm_row(case: str, k: int, rate: int, _with_loop: bool) -> dict[str, Any]:
    q, keys, w, plan, _rows, flops = _case(case, rate)
    pages = fp8_indexer.pack(keys, PAGE_ENTRIES)
    scale = DIM**-0.5
    lmax = plan.key_slots.shape[1]
    ours_maxima = indexer_select.maxima_buffer(q.shape[0], lmax, q.device)
    maxima = indexer_select.maxima_buffer(q.shape[0], lmax, q.device)

    def ours() -> torch.Tensor:
        return triton_indexer.indexer_logits_rows(q, pages, w, scale, plan, maxima=ours_maxima)

    def backend() -> torch.Tensor:
        return deepgemm_indexer.indexer_logits_rows(q, pages, w, scale, plan, maxima=maxima)

    want, got = ours(), backend()
    q8, scaled = triton_indexer.quantize_queries(q, w, scale)
    values, scales, start, end = deepgemm_indexer.gathered_keys(pages, plan)
    dg = deepgemm.load()
    seen = want != float("-inf")
    row: dict[str, Any] = {
        "case": case,
        "triton_ms": timed(ours),
        "deepgemm_ms": timed(backend),
        "deepgemm_kernel_ms": timed(
            lambda: dg.fp8_mqa_logits(q8, (values, scales), scaled, start, end, False, lmax)
        ),
        "gather_ms": timed(lambda: deepgemm_indexer.gathered_keys(pages, plan)),
        "same_infs": bool(torch.equal(seen, got != float("-inf"))),
        "same_bits_share": round(float((want == got)[seen].float().mean()), 4),
        "max_rel_diff": float(
            (want - got)[seen].abs().max() / want[seen].abs().max().clamp(min=1e-30)
        ),
        "maxima_of_own_scores": bool(
            torch.equal(maxima, indexer_select.group_maxima(got, torch.empty_like(maxima)))
        ),
    }
    for name in ("triton", "deepgemm", "deepgemm_kernel"):
        row[f"{name}_tflops"] = round(flops / row[f"{name}_ms"] / 1e9, 1)
    picks = topk_slots(want, plan, k, triton_topk.top_k_positions, ours_maxima)
    dg_picks = topk_slots(got, plan, k, triton_topk.top_k_positions, maxima)
    row["same_picks_share"] = round(float((picks == dg_picks).all(-1).float().mean()), 4)
    print(json.dumps(row), flush=True)
    torch.cuda.empty_cache()
    return row
