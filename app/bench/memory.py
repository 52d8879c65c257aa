"""Per-stage memory of a checkpoint at PP 2, 4 and 8, bf16 against FP8 weights, and the longest
context one H200 stage holds with a bf16 against an FP8 KV cache: computed by the loader's own
stage_memory_plan from a config.json (the stage modules built on the meta device).

    python -m app.bench.memory docs/bench/configs/deepseek_v32.json
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from stages.loader import stage_memory_plan
from stages.model_config import ModelArgs

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


def table(config: dict[str, Any], pp_sizes: tuple[int, ...] = (2, 4, 8)) -> str:
    args = ModelArgs.from_hf_dict(config)
    budget = int(H200_BYTES * UTILIZATION)
    lines = [
        "| PP | weights | total weights (GB) | largest stage (GB) | fits an H200 | KV per token, "
        "bf16 / FP8 (bytes, largest stage) | longest context, bf16 KV | FP8 KV |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for pp in pp_sizes:
        for fp8 in (False, True):
            bf16_kv = stage_memory_plan(args, pp, fp8, "auto")
            fp8_kv = stage_memory_plan(args, pp, fp8, "fp8")
            total = sum(s.weight_bytes for s in bf16_kv)
            largest = max(s.weight_bytes for s in bf16_kv)
            fits = largest < budget
            kv = (
                max(s.kv_bytes_per_token for s in bf16_kv),
                max(s.kv_bytes_per_token for s in fp8_kv),
            )
            ctx = [min(s.max_tokens(budget) for s in plan) for plan in (bf16_kv, fp8_kv)]
            lines.append(
                f"| {pp} | {'FP8' if fp8 else 'bf16'} | {total / 1e9:,.1f} | {largest / 1e9:,.1f} "
                f"| {'yes' if fits else 'no'} | {kv[0]:,} / {kv[1]:,} | "
                f"{ctx[0]:,} | {ctx[1]:,} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("config", help="a config.json")
    a = p.parse_args(argv)
    with open(a.config, encoding="utf-8") as f:
        print(table(json.load(f)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
