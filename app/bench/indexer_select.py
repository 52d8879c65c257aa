"""The indexer's selection per layer: the per-row loop (Triton scores of one row, its future
masked, torch.topk) against the batched plan (one scoring launch, one top-k), on the index heads
of V3.2 and V4 (64 x 128, keys in a paged cache); the scores over bf16 keys and over FP8 keys
(FP8 queries, stages/kernels/fp8_indexer.py), and the top-k on torch and on the candidates'
kernels (stages/kernels/triton_topk.py), whose picks must equal torch's under the rule.

    python -m app.bench.indexer_select --out docs/bench/indexer_select.json
    python -m app.bench.indexer_select --topk 512 --no-loop --cases 1x8192:262144 \
        --rate 4 --out docs/bench/indexer_v4_256k.json   # V4's CSA at the 256K last chunk
    python -m app.bench.indexer_select --chunk-launches --cases 1x8192:262144 --rate 4 \
        --out /tmp/chunk_launches.json   # the chunk kernel's launches over FP8 keys

Each row also times the last step alone, the rule's top-k of k + 8k candidates a line: torch's
top_k_positions against the one-program kernel (stages/kernels/triton_rule_topk.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
from collections.abc import Callable
from typing import Any

import torch

from app.bench.moe import timed
from stages.kernels import (
    fp8_indexer,
    indexer_select,
    triton_indexer,
    triton_rule_topk,
    triton_topk,
)
from stages.kernels.indexer_select import SelectPlan, topk_slots

HEADS, DIM = 64, 128
GATHER_SWEEP = (16, 32, 64)  # the compaction's taken groups a step (triton_topk.GATHER's default)
PAGE_ENTRIES = 16  # V4's indexer keys: a 64-token block at rate 4
# (first token in the batch, tokens, first position, the row's key slots)
Row = tuple[int, int, int, torch.Tensor]


def loop(
    q: torch.Tensor, keys: torch.Tensor, w: torch.Tensor, rows: list[Row], scale: float, k: int
) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for off, n, start, slots in rows:
        logits = triton_indexer.indexer_logits(
            q[off : off + n], keys.index_select(0, slots), w[off : off + n], scale
        )
        if n > 1:
            future = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
            logits[:, -n:].masked_fill_(future, float("-inf"))
        best, pos = logits.topk(k, dim=-1)
        out.append(slots[pos].masked_fill(best == float("-inf"), -1))
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cases", default="512x1:32768,128x1:65536,1x4096:32768,1x4096:131072")
    p.add_argument("--topk", type=int, default=2048, help="V3.2: 2048; V4: 512")
    p.add_argument("--rate", type=int, default=1, help="tokens per key (V4's CSA: 4)")
    p.add_argument("--no-loop", action="store_true", help="skip the per-row loop")
    p.add_argument(
        "--chunk-launches", action="store_true", help="sweep the chunk kernel's launches instead"
    )
    p.add_argument("--out", required=True)
    a = p.parse_args()
    case = chunk_launch_rows if a.chunk_launches else case_row
    results = [case(c, a.topk, a.rate, not a.no_loop) for c in a.cases.split(",")]
    with open(a.out, "w") as f:
        json.dump({"env": {"torch": torch.__version__}, "rows": results}, f, indent=1)


# (keys a program, warps, stages, registers a thread): the default, then fewer registers for
# three (128 keys) or four (64 keys) programs an SM (ptxas picks 232-239 registers: two an SM)
CHUNK_LAUNCHES = [
    triton_indexer.ChunkConfig(*launch)
    for launch in (
        (128, 4, 3, None), (128, 4, 3, 168), (128, 4, 2, 168), (128, 4, 4, 168),
        (64, 4, 3, None), (64, 4, 3, 128), (64, 4, 4, 128), (64, 4, 2, 128),
    )
]  # fmt: skip


def chunk_launch_rows(case: str, k: int, rate: int, _with_loop: bool) -> dict[str, Any]:
    """The chunk rows' scores over FP8 keys at each of CHUNK_LAUNCHES, with whether each
    launch's bits equal the default's."""
    q, keys, w, plan, _rows, flops = _case(case, rate)
    fp8_keys = fp8_indexer.pack(keys, PAGE_ENTRIES)
    scale = DIM**-0.5
    first = triton_indexer.indexer_logits_rows(q, fp8_keys, w, scale, plan)
    launches = []
    for cfg in CHUNK_LAUNCHES:
        out = triton_indexer.indexer_logits_rows(q, fp8_keys, w, scale, plan, config=cfg)
        ms = timed(lambda: triton_indexer.indexer_logits_rows(q, fp8_keys, w, scale, plan, cfg))
        launches.append(
            {
                **dataclasses.asdict(cfg),
                "ms": ms,
                "tflops": round(flops / ms / 1e9, 1),
                "same_bits": bool(torch.equal(out, first)),
            }
        )
        print(json.dumps({"case": case, **launches[-1]}), flush=True)
    torch.cuda.empty_cache()
    return {"case": case, "launches": launches}


def _case(
    case: str, rate: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, SelectPlan, list[Row], float]:
    """ROWSxTOKENS:LENGTH: ROWS rows of TOKENS tokens each (1: decode rows) at LENGTH tokens,
    so LENGTH / rate keys a row: queries, bf16 keys, head weights, the plan, the rows and the
    scores' FLOPs."""
    shape, length = case.split(":")
    count, tokens = map(int, shape.split("x"))
    keys_per_row = int(length) // rate
    # token i of a row sees start + i + 1 keys (at rate > 1 a little more than a V4 chunk's)
    start = keys_per_row - tokens
    g = torch.Generator(device="cuda").manual_seed(0)
    slots_total = count * keys_per_row
    keys = torch.randn(slots_total, DIM, generator=g, device="cuda").bfloat16()
    perm = torch.randperm(slots_total, generator=g, device="cuda")
    rows: list[Row] = [
        (r * tokens, tokens, start, perm[r * keys_per_row : (r + 1) * keys_per_row])
        for r in range(count)
    ]
    q = torch.randn(count * tokens, HEADS, DIM, generator=g, device="cuda").bfloat16()
    w = torch.randn(count * tokens, HEADS, generator=g, device="cuda")
    plan = SelectPlan.build([(*r, tokens == 1) for r in rows], torch.device("cuda"))
    flops = 2 * HEADS * DIM * count * tokens * (keys_per_row - tokens / 2)
    return q, keys, w, plan, rows, flops


def case_row(case: str, k: int, rate: int, with_loop: bool) -> dict[str, Any]:
    """ROWSxTOKENS:LENGTH: ROWS rows of TOKENS tokens each (1: decode rows) at LENGTH tokens,
    so LENGTH / rate keys a row."""
    q, keys, w, plan, rows, flops = _case(case, rate)
    count, tokens = len(rows), rows[0][1]
    keys_per_row = rows[0][3].numel()
    g = torch.Generator(device="cuda").manual_seed(1)
    scale = DIM**-0.5
    fp8_keys = fp8_indexer.pack(keys, PAGE_ENTRIES)
    row: dict[str, Any] = {"rows": count, "tokens_per_row": tokens, "keys": keys_per_row, "k": k}
    if with_loop:
        row["loop_ms"] = timed(lambda: loop(q, keys, w, rows, scale, k), reps=5)
    for name, ks in (("bf16", keys), ("fp8", fp8_keys)):
        ms = timed(lambda: triton_indexer.indexer_logits_rows(q, ks, w, scale, plan), reps=5)
        row[f"logits_{name}_ms"] = ms
        row[f"logits_{name}_tflops"] = round(flops / ms / 1e9, 1)
    logits = triton_indexer.indexer_logits_rows(q, fp8_keys, w, scale, plan)
    top_ks: list[tuple[str, Callable[[torch.Tensor, int], torch.Tensor]]] = [
        ("torch", indexer_select.top_k_positions),
        ("triton", triton_topk.top_k_positions),
        ("triton_by_step", functools.partial(triton_topk.top_k_positions, gather=None)),
        ("triton_g16", functools.partial(triton_topk.top_k_positions, group=16)),
    ]
    top_ks += [
        (f"triton_gather{n}", functools.partial(triton_topk.top_k_positions, gather=n))
        for n in GATHER_SWEEP
    ]
    for name, top_k in top_ks:
        row[f"topk_{name}_ms"] = timed(lambda: topk_slots(logits, plan, k, top_k), reps=5)
    # the models' call: the scores kernel writes the group maxima, the top-k skips its pass
    maxima = indexer_select.maxima_buffer(q.shape[0], logits.shape[1], logits.device)
    row["logits_fp8_with_maxima_ms"] = timed(
        lambda: triton_indexer.indexer_logits_rows(q, fp8_keys, w, scale, plan, maxima=maxima),
        reps=5,
    )
    row["topk_triton_given_maxima_ms"] = timed(
        lambda: topk_slots(logits, plan, k, triton_topk.top_k_positions, maxima), reps=5
    )
    # the candidates' top-k over whole lines (torch's past RULE_KERNEL_MAX_LINES), not prefixes
    triton_topk.CANDIDATE_PREFIX = False
    row["topk_triton_given_maxima_whole_lines_ms"] = timed(
        lambda: topk_slots(logits, plan, k, triton_topk.top_k_positions, maxima), reps=5
    )
    triton_topk.CANDIDATE_PREFIX = True
    want = indexer_select.top_k_positions(logits.clone(), k)
    row["topk_triton_equals_torch"] = bool(
        torch.equal(want, triton_topk.top_k_positions(logits.clone(), k))
    )
    row["topk_given_maxima_equals_torch"] = bool(
        torch.equal(want, triton_topk.top_k_positions(logits.clone(), k, maxima=maxima))
    )
    for n in GATHER_SWEEP:
        got = triton_topk.top_k_positions(logits.clone(), k, gather=n)
        row[f"topk_triton_gather{n}_equals_torch"] = bool(torch.equal(want, got))
    # the last step alone: the rule's top-k of the compaction's k + 8k candidates a line
    width = k + triton_topk.GROUP * k
    if triton_rule_topk.fits(width, k):
        values = logits.new_empty(logits.shape[0], width).copy_(logits[:, :1])  # ties
        values += torch.randn(values.shape, generator=g, device="cuda").relu()
        row["candidates_torch_ms"] = timed(
            lambda: indexer_select.top_k_positions(values.clone(), k), reps=5
        )
        row["candidates_rule_kernel_ms"] = timed(
            lambda: triton_rule_topk.rule_top_k(values, k), reps=5
        )
        row["candidates_rule_kernel_ranked_ms"] = timed(  # step 3 by counted ranks
            lambda: triton_rule_topk.rule_top_k(values, k, sort=False), reps=5
        )
        row["candidates_rule_equals_torch"] = bool(
            torch.equal(
                triton_rule_topk.rule_top_k(values, k),
                indexer_select.top_k_positions(values.clone(), k),
            )
        )
    print(json.dumps(row), flush=True)
    torch.cuda.empty_cache()
    return row


if __name__ == "__main__":
    main()
