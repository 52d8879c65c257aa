"""DeepGEMM's ``fp8_mqa_logits`` (the lightning indexer's FP8 scores on SM90, built from its
source: .gpu-deepgemm/) beside our chunk kernel (stages/kernels/triton_indexer.py) on
app.bench.indexer_select's cases: the time of each, TFLOP/s, how far DeepGEMM's scores are from
ours, and whether the rule's top-k picks the same keys from both.

DeepGEMM reads keys contiguous ([L, D] e4m3 and a float32 scale each) with a [start, end) range
per query, so each row's keys are gathered out of the pages first (timed with it). Its
"compressed" output (max_seqlen_k) is our [tokens, Lmax] line layout, columns past a token's
visible keys unwritten: they are set to -inf, and the group maxima the top-k reads are taken,
in one torch pass each (timed apart: a kernel of ours would fold them).
"""

from __future__ import annotations

import importlib
import json
from typing import Any

import torch

from app.bench.indexer_select import DIM, PAGE_ENTRIES, Row, _case
from app.bench.moe import timed
from stages.kernels import fp8_indexer, indexer_select, triton_indexer, triton_topk
from stages.kernels.indexer_select import SelectPlan, topk_slots


def gathered(
    pages: torch.Tensor, plan: SelectPlan, rows: list[Row]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(keys [L, D] e4m3, scales [L], start [Ts], end [Ts] int32): every row's visible keys one
    after another, and each token's range among them."""
    values, scales = fp8_indexer.split(pages)
    slots = torch.cat([s[: start + n] for _, n, start, s in rows]).long()
    block, entry = slots // pages.shape[1], slots % pages.shape[1]
    firsts = torch.tensor(
        [0] + [start + n for _, n, start, _ in rows[:-1]], device=pages.device
    ).cumsum(0)
    first = firsts[plan.token_row]
    return (
        values[block, entry].contiguous(),
        scales[block, entry].contiguous(),
        first.int(),
        (first + plan.visible).int(),
    )


def deepgemm_row(case: str, k: int, rate: int, _with_loop: bool) -> dict[str, Any]:
    dg = importlib.import_module("deep_gemm")
    q, keys, w, plan, rows, flops = _case(case, rate)
    pages = fp8_indexer.pack(keys, PAGE_ENTRIES)
    scale = DIM**-0.5
    lmax = plan.key_slots.shape[1]
    maxima = indexer_select.maxima_buffer(q.shape[0], lmax, q.device)
    ours = triton_indexer.indexer_logits_rows(q, pages, w, scale, plan, maxima=maxima)
    ours_maxima = maxima.clone()
    qv, qw = triton_indexer.quantize_queries(q, w, scale)
    kv, ks, start, end = gathered(pages, plan, rows)
    columns = torch.arange(lmax, device=q.device)

    def scores() -> torch.Tensor:
        return dg.fp8_mqa_logits(qv, (kv, ks), qw, start, end, False, lmax)

    def finished(raw: torch.Tensor) -> torch.Tensor:
        out = raw.masked_fill(columns[None, :] >= plan.visible[:, None], float("-inf"))
        indexer_select.group_maxima(out, maxima)
        return out

    got = finished(scores())
    seen = ours != float("-inf")
    row: dict[str, Any] = {
        "case": case,
        "ours_ms": timed(
            lambda: triton_indexer.indexer_logits_rows(q, pages, w, scale, plan, maxima=maxima)
        ),
        "deepgemm_ms": timed(scores),
        "deepgemm_gather_ms": timed(lambda: gathered(pages, plan, rows)),
        "deepgemm_and_finish_ms": timed(lambda: finished(scores())),
        "same_infs": bool(torch.equal(seen, got != float("-inf"))),
        "same_bits_share": round(float((ours == got)[seen].float().mean()), 4),
        "max_rel_diff": float(
            ((ours - got)[seen].abs().max() / ours[seen].abs().max().clamp(min=1e-30))
        ),
        "same_maxima": bool(torch.equal(ours_maxima, maxima)),
    }
    row["ours_tflops"] = round(flops / row["ours_ms"] / 1e9, 1)
    row["deepgemm_tflops"] = round(flops / row["deepgemm_ms"] / 1e9, 1)
    picks = topk_slots(ours, plan, k, triton_topk.top_k_positions, ours_maxima)
    dg_picks = topk_slots(got, plan, k, triton_topk.top_k_positions, maxima)
    row["same_picks_share"] = round(float((picks == dg_picks).all(-1).float().mean()), 4)
    print(json.dumps(row), flush=True)
    torch.cuda.empty_cache()
    return row
