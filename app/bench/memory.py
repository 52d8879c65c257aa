"""Per-stage memory of a checkpoint at PP 2, 4 and 8, bf16 against FP8 weights, and the longest
context one H200 stage holds with a bf16 against an FP8 KV cache: computed by the loader's own
stage_memory_plan from a config.json (the stage modules built on the meta device).

    python -m app.bench.memory docs/bench/configs/deepseek_v32.json

A family without an FP8 cache gets "n/a" in the FP8 KV columns and the reason under the table.
A checkpoint whose routed experts are MXFP4 (DeepSeek-V4's `expert_dtype: fp4`, or
--mxfp4-experts) gets a line comparing the experts as the stage holds them (stages/loader.py
dequantizes MXFP4 at load: ppserve has no FP4 GEMM) with their checkpoint size.
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


def _fp8_kv_plan(args: ModelArgs, pp: int, fp8: bool) -> tuple[list[StageMemory] | None, str]:
    try:
        return stage_memory_plan(args, pp, fp8, "fp8"), ""
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("config", help="a config.json")
    p.add_argument(
        "--mxfp4-experts",
        action="store_true",
        help="the checkpoint's routed experts are MXFP4 though the config does not say so "
        "(transformers' DeepseekV4Config defaults carry no expert_dtype)",
    )
    a = p.parse_args(argv)
    with open(a.config, encoding="utf-8") as f:
        print(table(json.load(f), mxfp4_experts=a.mxfp4_experts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
