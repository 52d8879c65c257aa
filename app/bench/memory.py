"""Per-stage memory of a checkpoint at PP 2, 4 and 8, bf16 against FP8 weights, and the longest
context one H200 stage holds with a bf16 against an FP8 KV cache: computed by the loader's own
stage_memory_plan from a config.json (the stage modules built on the meta device).

    python -m app.bench.memory docs/bench/configs/deepseek_v32.json

A family without an FP8 cache gets "n/a" in the FP8 KV columns and the reason under the table.
A checkpoint whose routed experts are MXFP4 (DeepSeek-V4's `expert_dtype: fp4`, or
--mxfp4-experts) gets a line comparing the experts as the stage holds them (stages/loader.py
dequantizes MXFP4 at load: ppserve has no FP4 GEMM) with their checkpoint size.

    python -m app.bench.memory docs/bench/configs/deepseek_v4_pro.json --pp-tp 8x1 4x2 2x4

adds the per-GPU table of tensor-parallel stages (--tp): one GPU's weights (rank 0 of the largest
stage) with FP8 weights, and with the routed experts in MXFP4 as the checkpoint stores them
(projected: the loader widens them today), its KV bytes per token and the context it holds.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from stages.kernels import mxfp4
from stages.loader import StageMemory, stage_memory_plan
from stages.model_config import ModelArgs
from stages.models.deepseek_v4.config import expert_dtype

H200_BYTES = 141 * 10**9  # HBM3e
UTILIZATION = 0.9  # --gpu-memory-utilization's default
MXFP4_BYTES_PER_VALUE = 0.5 + 1 / mxfp4.GROUP  # two values a byte, one e8m0 scale per group
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
    args: ModelArgs, pp: int, fp8: bool, tp: int = 1
) -> tuple[list[StageMemory] | None, str]:
    try:
        return stage_memory_plan(args, pp, fp8, "fp8", tp_size=tp), ""
    except ValueError as e:  # the family has no FP8 cache (yet)
        return None, str(e)


def table(
    config: dict[str, Any], pp_sizes: tuple[int, ...] = (2, 4, 8), mxfp4_experts: bool = False
) -> str:
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
            bf16_kv = stage_memory_plan(args, pp, fp8, "auto")
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
    if mxfp4_experts or fp4_experts(config):
        values = experts[False][0]
        held = ", ".join(
            f"{'FP8' if fp8 else 'bf16'} weights {experts[fp8][1] / 1e9:,.1f} GB" for fp8 in experts
        )
        lines.append(
            f"Routed experts: {values / 1e9:,.1f}B values, MXFP4 in the checkpoint "
            f"({values * MXFP4_BYTES_PER_VALUE / 1e9:,.1f} GB); dequantized at load, held as: "
            f"{held} (counted so above)."
        )
    return "\n".join(lines).rstrip()


def per_gpu_table(
    config: dict[str, Any], shapes: tuple[tuple[int, int], ...], mxfp4_experts: bool = False
) -> str:
    """One GPU of each PP x TP shape, FP8 weights, FP8 KV where the family has it; with MXFP4
    experts (the checkpoint's, or --mxfp4-experts) also the GPU with them kept in FP4."""
    fp4_shown = mxfp4_experts or fp4_experts(config)
    args = ModelArgs.from_hf_dict(config)
    budget = int(H200_BYTES * UTILIZATION)
    lines = [
        "| PP x TP | GPUs | per GPU, FP8 weights (GB) | per GPU, MXFP4 experts (GB) | fits an "
        "H200 (FP8 / MXFP4) | KV per token per GPU (bytes) | longest context (FP8 / MXFP4) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for pp, tp in shapes:
        plan, _why = _fp8_kv_plan(args, pp, True, tp)
        kv = "fp8"
        if plan is None:
            plan, kv = stage_memory_plan(args, pp, True, "auto", tp_size=tp), "bf16"
        fp8 = max(plan, key=lambda st: st.weight_bytes)
        fp4 = [
            st.weight_bytes
            - st.routed_expert_bytes
            + round(st.routed_expert_values * MXFP4_BYTES_PER_VALUE)
            for st in plan
        ]
        fits = ["yes" if w < budget else "no" for w in (fp8.weight_bytes, max(fp4))]
        if not fp4_shown:
            fits[1] = "n/a"
        ctx_fp8 = min(st.max_tokens(budget) for st in plan)
        ctx_fp4 = min(max(0, budget - w) // st.kv_bytes_per_token for st, w in zip(plan, fp4))
        held_fp4 = f"{max(fp4) / 1e9:,.1f}" if fp4_shown else "n/a (FP8 experts)"
        ctx = f"{ctx_fp8:,} / {ctx_fp4:,}" if fp4_shown else f"{ctx_fp8:,} / n/a"
        lines.append(
            f"| {pp} x {tp} | {pp * tp} | {fp8.weight_bytes / 1e9:,.1f} | {held_fp4} "
            f"| {fits[0]} / {fits[1]} | {max(st.kv_bytes_per_token for st in plan):,} ({kv}) "
            f"| {ctx} |"
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
    print(table(config, mxfp4_experts=a.mxfp4_experts))
    if a.pp_tp:
        print()
        print(per_gpu_table(config, tuple(a.pp_tp), a.mxfp4_experts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
