"""V3.2's indexer selection per layer: the per-row loop (Triton scores of one row, its future
masked, torch.topk) against the batched plan (one scoring launch, one top-k), on V3.2's index
heads (64 x 128, bf16 keys in a paged cache).

    python -m app.bench.indexer_select --out docs/bench/indexer_select.json
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from app.bench.moe import timed
from stages.kernels import triton_indexer
from stages.kernels.indexer_select import SelectPlan, topk_slots

TOPK, HEADS, DIM = 2048, 64, 128
# (first token in the batch, tokens, first position, the row's key slots)
Row = tuple[int, int, int, torch.Tensor]


def loop(
    q: torch.Tensor, keys: torch.Tensor, w: torch.Tensor, rows: list[Row], scale: float
) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for off, n, start, slots in rows:
        logits = triton_indexer.indexer_logits(
            q[off : off + n], keys.index_select(0, slots), w[off : off + n], scale
        )
        if n > 1:
            future = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
            logits[:, -n:].masked_fill_(future, float("-inf"))
        best, pos = logits.topk(TOPK, dim=-1)
        out.append(slots[pos].masked_fill(best == float("-inf"), -1))
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cases", default="512x1:32768,128x1:65536,1x4096:32768,1x4096:131072")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    results: list[dict[str, Any]] = []
    for case in a.cases.split(","):
        shape, length = case.split(":")
        count, n = map(int, shape.split("x"))
        start = int(length) - n
        g = torch.Generator(device="cuda").manual_seed(0)
        slots_total = count * int(length)
        keys = torch.randn(slots_total, DIM, generator=g, device="cuda").bfloat16()
        perm = torch.randperm(slots_total, generator=g, device="cuda")
        rows: list[Row] = [
            (r * n, n, start, perm[r * int(length) : (r + 1) * int(length)]) for r in range(count)
        ]
        q = torch.randn(count * n, HEADS, DIM, generator=g, device="cuda").bfloat16()
        w = torch.randn(count * n, HEADS, generator=g, device="cuda")
        plan = SelectPlan.build([(*r, r[1] == 1) for r in rows], torch.device("cuda"))
        scale = DIM**-0.5

        def batched() -> torch.Tensor:
            logits = triton_indexer.indexer_logits_rows(q, keys, w, scale, plan)
            return topk_slots(logits, plan, TOPK)

        row: dict[str, Any] = {"rows": count, "tokens_per_row": n, "keys": int(length)}
        row["loop_ms"] = timed(lambda: loop(q, keys, w, rows, scale), reps=5)
        row["batched_ms"] = timed(batched, reps=5)
        row["batched_logits_ms"] = timed(
            lambda: triton_indexer.indexer_logits_rows(q, keys, w, scale, plan), reps=5
        )
        logits = triton_indexer.indexer_logits_rows(q, keys, w, scale, plan)
        row["batched_topk_ms"] = timed(lambda: topk_slots(logits, plan, TOPK), reps=5)
        flops = 2 * HEADS * DIM * count * n * (int(length) - n / 2)
        row["batched_logits_tflops"] = round(flops / row["batched_logits_ms"] / 1e9, 1)
        print(json.dumps(row), flush=True)
        results.append(row)
        torch.cuda.empty_cache()
    with open(a.out, "w") as f:
        json.dump({"env": {"torch": torch.__version__}, "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
