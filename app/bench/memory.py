"""Per-stage memory of a checkpoint at PP 2, 4 and 8, bf16 against FP8 weights, and the longest
context one H200 stage holds with a bf16 against an FP8 KV cache: computed by the loader's own
stage_memory_plan from a config.json (the stage modules built on the meta device).

    python -m app.bench.memory docs/bench/configs/deepseek_v32.json

A family without an FP8 cache gets "n/a" in the FP8 KV columns and the reason under the table.
A checkpoint whose routed experts are MXFP4 (DeepSeek-V4's `expert_dtype: fp4`, or
--mxfp4-experts) is counted with the experts as `--mxfp4-experts keep` holds them: packed (uint8
e2m1 pairs + e8m0 scale bytes), the other weights bf16 or FP8; a line under the table gives the
experts' bytes packed and dequantized (the engine's default).

    python -m app.bench.memory docs/bench/configs/deepseek_v4_pro.json --pp-tp 8x1 4x2 2x4 8x2

adds the per-GPU table of tensor-parallel stages (--tp): one GPU's weights (rank 0 of the largest
stage) with FP8 weights, the routed experts dequantized to FP8 (--mxfp4-experts dequantize) and
kept MXFP4 (keep), both from the stage modules the loader builds, its KV bytes per token and the
context it holds.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from stages.loader import StageMemory, stage_memory_plan
from stages.model_config import ModelArgs
from stages.models.deepseek_v4.config import expert_dtype

H200_BYTES = 141 * 10**9  # HBM3e
UTILIZATION = 0.9  # --gpu-memory-utilization's default
# Beside weights and KV: a long prompt's chunk activations (an 8K chunk's four residual streams,
# MoE intermediates, the sparse references' tiles, the indexer's score tiles).
ACTIVATION_BYTES = 8 * 10**9


def layers_on_one_gpu(config: dict[str, Any], context: int) -> int:
    """The most leading layers of `config` (bf16 weights, bf16 KV) whose one stage holds a
    `context`-token KV cache on one H200 with ACTIVATION_BYTES to spare."""
    budget = int(H200_BYTES * UTILIZATION) - ACTIVATION_BYTES
    fitting = 0
    for n in range(1, int(config["num_hidden_layers"]) + 1):
        (stage,) = stage_memory_plan(ModelArgs.from_hf_dict(leading_layers(config, n)), 1, False)
        if stage.weight_bytes + context * stage.kv_bytes_per_token > budget:
            break
        fitting = n
    return fitting


def leading_layers(config: dict[str, Any], n: int) -> dict[str, Any]:
    """`config` cut to its first n layers, their per-layer patterns kept."""
    out = dict(config, num_hidden_layers=n)
    for key in ("layer_types", "mlp_layer_types", "compress_ratios"):
        if config.get(key) is not None:
            out[key] = list(config[key][:n])
    return out


def fp4_experts(config: dict[str, Any]) -> bool:
    return expert_dtype(config) == "fp4"


def _fp8_kv_plan(
    args: ModelArgs, pp: int, fp8: bool, tp: int = 1, mxfp4_experts: str = "keep"
) -> tuple[list[StageMemory] | None, str]:
    try:
        return stage_memory_plan(args, pp, fp8, "fp8", tp_size=tp, mxfp4_experts=mxfp4_experts), ""
    except ValueError as e:  # the family has no FP8 cache (yet)
        return None, str(e)


def table(config: dict[str, Any], pp_sizes: tuple[int, ...] = (2, 4, 8)) -> str:
    args = ModelArgs.from_hf_dict(config)
    budget = int(H200_BYTES * UTILIZATION)
    lines = [
        "| PP | weights | total weights (GB) | largest stage (GB) | fits an H200 | KV per token, "
        "bf16 / FP8 (bytes, largest stage) | longest context, bf16 KV | FP8 KV |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    notes: list[str] = []
    experts: dict[bool, tuple[int, int]] = {}
    for pp in pp_sizes:
        for fp8 in (False, True):
            bf16_kv = stage_memory_plan(args, pp, fp8, "auto", mxfp4_experts="keep")
            fp8_kv, why = _fp8_kv_plan(args, pp, fp8)
            if why and why not in notes:
                notes.append(why)
            total = sum(s.weight_bytes for s in bf16_kv)
            largest = max(s.weight_bytes for s in bf16_kv)
            kv_bf16 = max(s.kv_bytes_per_token for s in bf16_kv)
            ctx_bf16 = min(s.max_tokens(budget) for s in bf16_kv)
            if fp8_kv is None:
                kv_fp8, ctx_fp8 = "n/a", "n/a"
            else:
                kv_fp8 = f"{max(s.kv_bytes_per_token for s in fp8_kv):,}"
                ctx_fp8 = f"{min(s.max_tokens(budget) for s in fp8_kv):,}"
            lines.append(
                f"| {pp} | {'FP8' if fp8 else 'bf16'} | {total / 1e9:,.1f} | {largest / 1e9:,.1f} "
                f"| {'yes' if largest < budget else 'no'} | {kv_bf16:,} / {kv_fp8} | "
                f"{ctx_bf16:,} | {ctx_fp8} |"
            )
            experts[fp8] = (
                sum(s.routed_expert_values for s in bf16_kv),
                sum(s.routed_expert_bytes for s in bf16_kv),
            )
    lines.append("")
    lines.extend(f"FP8 KV n/a: {why}" for why in notes)
    if fp4_experts(config):
        values, packed = experts[False]
        wide = {
            fp8: sum(s.routed_expert_bytes for s in stage_memory_plan(args, 1, fp8, **WIDE))
            for fp8 in (False, True)
        }
        lines.append(
            f"Routed experts: {values / 1e9:,.1f}B values, MXFP4 in the checkpoint, held packed "
            f"{packed / 1e9:,.1f} GB (counted so above); dequantized at load "
            f"(--mxfp4-experts dequantize): bf16 {wide[False] / 1e9:,.1f} GB, "
            f"FP8 {wide[True] / 1e9:,.1f} GB."
        )
    return "\n".join(lines).rstrip()


WIDE: dict[str, Any] = {"mxfp4_experts": "dequantize"}


def per_gpu_table(config: dict[str, Any], shapes: tuple[tuple[int, int], ...]) -> str:
    """One GPU of each PP x TP shape, FP8 weights, FP8 KV where the family has it: with the
    routed experts dequantized to FP8, and (MXFP4 experts) kept packed, each as the loader
    builds the stage."""
    fp4_shown = fp4_experts(config)
    args = ModelArgs.from_hf_dict(config)
    budget = int(H200_BYTES * UTILIZATION)
    lines = [
        "| PP x TP | GPUs | per GPU, FP8 weights + FP8 experts (GB) | per GPU, FP8 weights + "
        "MXFP4 experts (GB) | fits an H200 (FP8 / MXFP4) | KV per token per GPU (bytes) | "
        "longest context (FP8 / MXFP4) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for pp, tp in shapes:
        plans, kv = {}, "fp8"
        for mode in ("dequantize", "keep"):
            plan, _why = _fp8_kv_plan(args, pp, True, tp, mode)
            if plan is None:
                plan, kv = (
                    stage_memory_plan(args, pp, True, "auto", tp_size=tp, mxfp4_experts=mode),
                    "bf16",
                )
            plans[mode] = plan
        largest = {m: max(st.weight_bytes for st in p) for m, p in plans.items()}
        ctx = {m: min(st.max_tokens(budget) for st in p) for m, p in plans.items()}
        fits = {m: "yes" if w < budget else "no" for m, w in largest.items()}
        wide, kept = "dequantize", "keep"
        held = f"{largest[kept] / 1e9:,.1f}" if fp4_shown else "n/a (no MXFP4 experts)"
        lines.append(
            f"| {pp} x {tp} | {pp * tp} | {largest[wide] / 1e9:,.1f} | {held} "
            f"| {fits[wide]} / {fits[kept] if fp4_shown else 'n/a'} "
            f"| {max(st.kv_bytes_per_token for st in plans[kept]):,} ({kv}) "
            f"| {ctx[wide]:,} / {f'{ctx[kept]:,}' if fp4_shown else 'n/a'} |"
        )
    return "\n".join(lines)


def _shape(text: str) -> tuple[int, int]:
    pp, _, tp = text.partition("x")
    return int(pp), int(tp or 1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("config", help="a config.json")
    p.add_argument(
        "--mxfp4-experts",
        action="store_true",
        help="the checkpoint's routed experts are MXFP4 though the config does not say so "
        "(transformers' DeepseekV4Config defaults carry no expert_dtype)",
    )
    p.add_argument(
        "--pp-tp",
        nargs="+",
        type=_shape,
        default=(),
        metavar="PPxTP",
        help="also the per-GPU table of these PP x TP shapes (e.g. 8x1 4x2 2x4)",
    )
    a = p.parse_args(argv)
    with open(a.config, encoding="utf-8") as f:
        config = json.load(f)
    if a.mxfp4_experts:
        config = dict(config, expert_dtype="fp4")
    print(table(config))
    if a.pp_tp:
        print()
        print(per_gpu_table(config, tuple(a.pp_tp)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
