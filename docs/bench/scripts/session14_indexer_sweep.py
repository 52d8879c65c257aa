"""Session 14: the indexer's kernels swept on the H200 over their launches. The chunk kernel
(keys a program, warps, stages; calls 2 and 3 also swept two heads a step, 128-token tiles and
the keys as the MMA's rows, none faster, since taken out of the kernel), FP8 pages and bf16 keys, V4's CSA at the last 8K chunk of a 256K
prompt (8192 queries x 64K keys, 64 x 128 heads); the decode rows (512 x 64K) over FP8 pages and
bf16 keys (keys a program, warps); the query quantizer, one kernel against torch's ops. Each
config's scores are checked against the default's (a broken config is reported, not timed).
One JSON line a config.

    python docs/bench/scripts/session14_indexer_sweep.py --out sweep.jsonl
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from app.bench.moe import timed
from stages.kernels import fp8_indexer, indexer_select, triton_indexer
from stages.kernels.triton_indexer import ChunkConfig, DecodeConfig

HEADS, DIM, ENTRIES = 64, 128, 16


def case(count: int, tokens: int, keys_per_row: int, tile: int):
    indexer_select.CHUNK_TILE = tile  # the plan's tiles and the kernel's BT follow it
    g = torch.Generator(device="cuda").manual_seed(0)
    total = count * keys_per_row
    keys = torch.randn(total, DIM, generator=g, device="cuda").bfloat16()
    perm = torch.randperm(total, generator=g, device="cuda")
    start = keys_per_row - tokens
    rows = [
        (r * tokens, tokens, start, perm[r * keys_per_row : (r + 1) * keys_per_row], tokens == 1)
        for r in range(count)
    ]
    plan = indexer_select.SelectPlan.build(rows, torch.device("cuda"))
    q = torch.randn(count * tokens, HEADS, DIM, generator=g, device="cuda").bfloat16()
    w = torch.randn(count * tokens, HEADS, generator=g, device="cuda")
    flops = 2 * HEADS * DIM * count * tokens * (keys_per_row - tokens / 2)
    return q, keys, fp8_indexer.pack(keys, ENTRIES), w, plan, flops


def emit(out, row):
    print(json.dumps(row), flush=True)
    out.write(json.dumps(row) + "\n")
    out.flush()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--keys", type=int, default=65536)
    a = p.parse_args()
    scale = DIM**-0.5
    with open(a.out, "w") as out:
        refs = {}
        for tile in (64,):
            q, keys, pages, w, plan, flops = case(1, 8192, a.keys, tile)
            for name, ks in (("fp8", pages), ("bf16", keys)):
                if name not in refs:
                    refs[name] = triton_indexer.indexer_logits_rows(
                        q, ks, w, scale, plan, ChunkConfig()
                    )
                ref = refs[name]
                grid = itertools.product((128, 256), (4, 8), (3,))
                for bl, warps, stages in grid:
                    if tile * bl // (32 * warps) > 128:
                        continue  # the accumulator alone would spill
                    cfg = ChunkConfig(bl, warps, stages)
                    row = {"keys": name, "tile": tile, **cfg.__dict__}
                    try:
                        got = triton_indexer.indexer_logits_rows(q, ks, w, scale, plan, cfg)
                        seen = ref != float("-inf")
                        row["equal_seen"] = bool(torch.equal(got != float("-inf"), seen))
                        err = ((got[seen] - ref[seen]).abs().max() / ref[seen].abs().max()).item()
                        row["max_rel_err"] = err
                        if err < 1e-4 and row["equal_seen"]:
                            ms = timed(
                                lambda: triton_indexer.indexer_logits_rows(
                                    q, ks, w, scale, plan, cfg
                                ),
                                reps=5,
                            )
                            row["ms"] = round(ms, 3)
                            row["tflops"] = round(flops / ms / 1e9, 1)
                    except Exception as e:  # a config that does not compile / fit
                        row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                    emit(out, row)
            del q, keys, pages, w, plan
            torch.cuda.empty_cache()
        q, keys, pages, w, plan, flops = case(512, 1, a.keys, 64)
        ref = triton_indexer.indexer_logits_rows(q, keys, w, scale, plan)
        seen = ref != float("-inf")
        for name, ks in (("bf16", keys), ("fp8", pages)):
            for bl, warps in itertools.product((32, 64, 128), (4, 8)):
                cfg = DecodeConfig(bl, warps)
                row = {"decode": 512, "keys": name, **cfg.__dict__}
                try:
                    got = triton_indexer.indexer_logits_rows(q, ks, w, scale, plan, decode=cfg)
                    err = ((got[seen] - ref[seen]).norm() / ref[seen].norm()).item()
                    row["rel_err_vs_bf16"] = round(err, 4)
                    row["ms"] = round(
                        timed(
                            lambda: triton_indexer.indexer_logits_rows(
                                q, ks, w, scale, plan, decode=cfg
                            ),
                            reps=5,
                        ),
                        3,
                    )
                except Exception as e:
                    row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                emit(out, row)
        qs = q.view(512, HEADS, DIM)
        emit(
            out,
            {
                "quantize_queries_512_ms": round(
                    timed(lambda: triton_indexer.quantize_queries(qs, w, scale), reps=5), 4
                )
            },
        )
        emit(
            out,
            {
                "quantize_queries_torch_512_ms": round(
                    timed(lambda: fp8_indexer.quantize_queries(qs), reps=5), 4
                )
            },
        )


if __name__ == "__main__":
    main()
