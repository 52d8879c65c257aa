"""DeepSeek's sparse selection on the GPU: the tie rule's cost and exactness, and whether a
request's greedy tokens depend on what it is batched with (issue 33).

    python -m app.bench.batch_invariance rule --out rule.json
    python -m app.bench.batch_invariance kernels --out kernels.json
    python -m app.bench.batch_invariance engine --model-shape deepseek-v32-bench --layers 4 \
        --kv-cache-dtype fp8 --out engine.json

rule   — top_k_positions (the rule: highest score, then lower position, over distinct int64
         keys) against torch's plain top-k of the float scores, at the selection shapes of a
         prefill chunk and a decode step; and, on scores full of exact ties, whether each equals
         a stable descending sort's first k (the rule's definition).
kernels — each kernel of the DeepSeek path on the registry's CUDA choices: a row's output bits
         alone (8 rows) against inside a batch of 600; the indexer's score of a token in a chunk
         against the same token as a one-token prefill chunk and as a decode row.
engine — a fixed prompt set (lengths around index_topk, the window, the block and chunk size)
         served alone, all at once, and with staggered arrivals, greedy, random weights of the
         shape: per prompt, the first step where the batched tokens leave the lone ones. The
         selection is exact whatever the batch; what may still differ is arithmetic that is not
         batch-invariant by construction (FlashMLA's split-KV decode, whose splits follow the
         batch; the MoE's tiles, chosen by the token count).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections.abc import Callable
from typing import Any

from app.bench.target import BenchEngine, add_model_args, environment, start_local_ray, write_model
from app.request import Prompt

# (tokens, candidates, k): V4-Flash CSA at the last 8K chunk of 64K / 256K (entries = tokens / 4,
# top-512), V3.2 at an 8K chunk over 64K keys (top-2048), and a 512-row decode step of each
RULE_SHAPES = (
    (8192, 16384, 512),
    (8192, 65536, 512),
    (8192, 65536, 2048),
    (512, 65536, 2048),
    (512, 65536, 512),
)


def rule(a: argparse.Namespace) -> dict[str, Any]:
    import torch

    from app.bench.moe import timed
    from stages.kernels.indexer_select import top_k_positions

    rows: list[dict[str, Any]] = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for tokens, width, k in RULE_SHAPES:
        scores = torch.randn(tokens, width, generator=g, device="cuda")
        tied = scores.relu().round()  # about half exact zeros, the rest on a few values
        row: dict[str, Any] = {"tokens": tokens, "candidates": width, "k": k}
        row["float_topk_ms"] = timed(lambda: scores.topk(k, dim=-1), reps=a.reps)
        row["rule_ms"] = timed(lambda: top_k_positions(scores, k), reps=a.reps)
        stable = torch.sort(tied, dim=-1, descending=True, stable=True).indices[:, :k]
        row["rule_equals_stable_sort"] = bool(torch.equal(top_k_positions(tied, k), stable))
        plain = tied.topk(k, dim=-1).indices
        row["float_topk_set_equals_rule"] = bool(
            torch.equal(plain.sort(dim=-1).values, stable.sort(dim=-1).values)
        )
        rows.append(row)
        print(
            f"{tokens:5d} x {width:6d} top-{k:4d}: float top-k {row['float_topk_ms']:.3f} ms, "
            f"rule {row['rule_ms']:.3f} ms; rule == stable sort: {row['rule_equals_stable_sort']}"
            f"; float top-k keeps the rule's set: {row['float_topk_set_equals_rule']}"
        )
    return {"rows": rows}


def kernels(a: argparse.Namespace) -> dict[str, Any]:
    """Whether each kernel of the DeepSeek path gives a row the same bits alone (8 rows) and
    inside a batch (the same 8 rows first of 600), on the registry's CUDA choices; and the
    indexer's score of one token as a one-token row against the same token inside a chunk."""
    import torch

    from stages.kernels.indexer_select import SelectPlan
    from stages.kernels.registry import select_kernels

    ks: Any = select_kernels("cuda")  # every op this shape uses is set on CUDA
    g = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device="cuda") * 0.1).to(dtype)

    n, few = 600, 8
    hidden, inter, experts = 2048, 1408, 64
    w, gate_up, down = (
        rand(4096, hidden),
        rand(experts, 2 * inter, hidden),
        rand(experts, hidden, inter),
    )
    ids = torch.randint(0, experts, (n, 6), generator=g, device="cuda")
    weights = torch.rand(n, 6, generator=g, device="cuda")
    kv, kv4 = rand(20000, 1, 576), rand(20000, 512)
    idx = torch.randint(0, 20000, (n, 2048), generator=g, device="cuda").int()
    sinks = torch.randn(64, generator=g, device="cuda")
    x, q, q4 = rand(n, hidden), rand(n, 64, 576), rand(n, 64, 512)
    ops: dict[str, Callable[[int], Any]] = {
        "linear": lambda m: ks.linear(x[:m], w),
        "moe_experts": lambda m: ks.moe_experts(x[:m], gate_up, down, ids[:m], weights[:m]),
        "mla_sparse": lambda m: ks.mla_sparse(q[:m], kv, idx[:m], 512, 0.04),
        "sparse_sink_attention": lambda m: ks.sparse_sink_attention(
            q4[:m], kv4, idx[:m, :640], sinks, 0.04
        ),
    }
    rows: list[dict[str, Any]] = []
    for op, fn in ops.items():
        alone, batched = fn(few), fn(n)[:few]
        row: dict[str, Any] = {
            "op": op,
            "backend": ks.names.get(op, "?"),
            "bit_equal": bool(torch.equal(alone, batched)),
        }
        row["max_abs_diff"] = float((alone.float() - batched.float()).abs().max())
        rows.append(row)
    # the indexer: the last token of a 2-token chunk, against the same token as a one-token
    # prefill chunk (scored as a chunk) and as a decode row (heads as the MMA's rows)
    iq, ik, iw = rand(2, 64, 128), rand(5000, 128), torch.rand(2, 64, generator=g, device="cuda")
    slots = torch.arange(4000, device="cuda")
    two = SelectPlan.build([(0, 2, 3998, slots, False)], torch.device("cuda"))
    score = ks.indexer_logits_rows
    in_chunk = score(iq, ik, iw, 0.088, two)[1]
    for kind, decode in (("one-token prefill chunk", False), ("decode row", True)):
        one = SelectPlan.build([(0, 1, 3999, slots, decode)], torch.device("cuda"))
        alone = score(iq[1:], ik, iw[1:], 0.088, one)[0]
        rows.append(
            {
                "op": f"indexer_logits_rows ({kind} vs in a chunk)",
                "backend": ks.names.get("indexer_logits", "?"),
                "bit_equal": bool(torch.equal(alone, in_chunk)),
                "max_abs_diff": float((alone - in_chunk).abs().max()),
            }
        )
    for r in rows:
        print(
            f"{r['op']:45s} {r['backend']:12s} bit-equal {r['bit_equal']}, "
            f"max |diff| {r['max_abs_diff']:.3g}"
        )
    return {"rows": rows}


def prompt_lengths(shape: str) -> list[int]:
    """Around the shape's thresholds: V3.2's top-2048 keys; V4's window (128), HCA rate (128),
    and 512 CSA entries of 4 tokens; chunks of 2048; and longer prompts of several chunks."""
    if shape == "deepseek-v4-flash":
        return [100, 129, 2047, 2049, 2600, 4097, 6000, 9000]
    return [1000, 2047, 2049, 2100, 3000, 4097, 6000, 9000]


async def _staggered(
    engine: BenchEngine, prompts: list[Prompt], params: Any, gap: float
) -> list[list[int]]:
    async def one(i: int) -> list[int]:
        await asyncio.sleep(gap * i)
        return (await engine.timed(prompts[i], params))[1]

    return list(await asyncio.gather(*(one(i) for i in range(len(prompts)))))


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def engine(a: argparse.Namespace) -> dict[str, Any]:
    from app.request import SamplingParams

    model_dir, load_format, model_cfg = write_model(a.model_shape, a.layers)
    owns_ray = start_local_ray(1, "cuda")
    rng = random.Random(a.seed)
    lengths = prompt_lengths(a.model_shape)
    prompts: list[Prompt] = [[rng.randrange(100, 30000) for _ in range(n)] for n in lengths]
    greedy = SamplingParams(max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    try:
        with BenchEngine(
            model=model_dir,
            load_format=load_format,
            device="cuda",
            pp_size=1,
            chunk_size=a.chunk_size,
            kv_cache_dtype=a.kv_cache_dtype,
            max_num_seqs=len(prompts),
            max_model_len=16384,
        ) as eng:
            load_s = time.perf_counter() - t0
            alone = [eng.generate([p], greedy)[0].token_ids for p in prompts]
            together = [o.token_ids for o in eng.generate(prompts, greedy)]
            staggered = asyncio.run(_staggered(eng, prompts, greedy, a.gap))
    finally:
        if owns_ray:
            import ray

            ray.shutdown()
    rows: list[dict[str, Any]] = []
    for p, lone, batched, stag in zip(prompts, alone, together, staggered):
        rows.append(
            {
                "prompt_len": len(p),
                "first_difference_batched": first_difference(lone, batched),
                "first_difference_staggered": first_difference(lone, stag),
                "alone": lone,
                "batched": batched,
                "staggered": stag,
            }
        )
    differ = sum(
        r["first_difference_batched"] is not None or r["first_difference_staggered"] is not None
        for r in rows
    )
    print(
        f"{a.model_shape} ({a.layers} layers, KV {a.kv_cache_dtype}): {differ} of {len(rows)} "
        f"prompts' greedy tokens differ batched vs alone (load {load_s:.0f} s)"
    )
    for r in rows:
        print(
            f"  {r['prompt_len']:5d} tokens: first difference batched "
            f"{r['first_difference_batched']}, staggered {r['first_difference_staggered']}"
        )
    return {"model": model_cfg, "prompts_differing": differ, "rows": rows}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m app.bench.batch_invariance",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("part", choices=("rule", "kernels", "engine"))
    add_model_args(p, shapes=("deepseek-v32-bench", "deepseek-v4-flash"))
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--chunk-size", type=int, default=2048)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--gap", type=float, default=0.05, help="seconds between staggered arrivals")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="batch_invariance.json")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = build_parser().parse_args(argv)
    res = {"rule": rule, "kernels": kernels, "engine": engine}[a.part](a)
    res |= {
        "command": "python -m app.bench.batch_invariance " + " ".join(argv),
        "environment": environment(),
    }
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
