"""Session 14: the indexer's chunk kernel swept on the H200 over its launch (tokens a tile,
keys a program, heads unrolled, warps, stages, which operand the keys are), FP8 pages and bf16 keys, V4's CSA at the last
8K chunk of a 256K prompt (8192 queries x 64K keys, 64 x 128 heads); and the decode rows (512 x
64K) over FP8 pages widened or not, against bf16 keys. Each config's scores are checked against
the default's (a broken config is reported, not timed). One JSON line a config.

    python docs/bench/scripts/session14_indexer_sweep.py --out sweep.jsonl
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from app.bench.moe import timed
from stages.kernels import fp8_indexer, indexer_select, triton_indexer
from stages.kernels.triton_indexer import ChunkConfig

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
        for tile in (64, 128):
            q, keys, pages, w, plan, flops = case(1, 8192, a.keys, tile)
            for name, ks in (("fp8", pages), ("bf16", keys)):
                if name not in refs:
                    refs[name] = triton_indexer.indexer_logits_rows(q, ks, w, scale, plan)
                ref = refs[name]
                grid = itertools.product((128, 256), (1, 2), (4, 8), (2, 3), (False, True))
                for bl, step, warps, stages, keys_as_rows in grid:
                    if tile * bl // (32 * warps) > 128:
                        continue  # the accumulator alone would spill
                    if name == "bf16" and (stages == 2 or step == 2):
                        continue
                    cfg = ChunkConfig(bl, step, warps, stages, keys_as_rows)
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
        for name, ks, widen in (("bf16", keys, True), ("fp8", pages, True), ("fp8", pages, False)):
            got = triton_indexer.indexer_logits_rows(q, ks, w, scale, plan, widen=widen)
            fn = lambda: triton_indexer.indexer_logits_rows(q, ks, w, scale, plan, widen=widen)  # noqa: E731
            ms = timed(fn, reps=5)
            seen = ref != float("-inf")
            err = ((got[seen] - ref[seen]).norm() / ref[seen].norm()).item()
            emit(
                out,
                {
                    "decode": 512,
                    "keys": name,
                    "widen": widen,
                    "ms": round(ms, 3),
                    "rel_err_vs_bf16": round(err, 4),
                },
            )


if __name__ == "__main__":
    main()
