"""Distance to the hardware of the suite's rows: prefill TFLOP/s against the H200's measured
bf16 and FP8 GEMM rates, decode bytes per step against its HBM bandwidth.

FLOPs come from the scheduler's own chunk cost (app.scheduler.chunking.ChunkCost: 2 per weight
per token, 4 * heads * head_dim per query-key pair), fed the active MLP width of MoE layers.
For MLA (DeepSeek) shapes this is an estimate: attention is counted as GQA of the config's
heads and head_dim, V3.2's indexer as dense pairs of its own heads, sparse attention at
index_topk keys a query, V4's compressed keys at their compression rate beside its window.
Good enough to say how far a row is from the chip, not to 1 %.
"""

from __future__ import annotations

from typing import Any

from app.scheduler.chunking import ChunkCost

H200_BF16_TFLOPS = 790.0  # dense bf16 GEMMs alone: 752-793 TF/s (docs/bench/CONTENTION.md)
H200_FP8_TFLOPS = 1580.0  # twice bf16, the FP8 tensor cores' ratio (not measured here)
H200_HBM_TBS = 4.8  # the data sheet's


def _experts(cfg: dict[str, Any]) -> tuple[int, int, int]:
    """(routed experts, top-k, shared experts); (0, 0, 0) for a dense model."""
    routed = cfg.get("n_routed_experts") or cfg.get("num_experts") or 0
    return routed, cfg.get("num_experts_per_tok") or 0, cfg.get("n_shared_experts") or 0


def _mlp_widths(cfg: dict[str, Any], experts_read: float) -> list[float]:
    """Per layer: the MLP width a token computes (experts_read = routed experts counted)."""
    routed, _, shared = _experts(cfg)
    layers = cfg["num_hidden_layers"]
    if not routed:
        return [float(cfg["intermediate_size"])] * layers
    dense = cfg.get("first_k_dense_replace") or 0
    moe = float(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
    return [
        float(cfg.get("intermediate_size", 0)) if i < dense else moe * (experts_read + shared)
        for i in range(layers)
    ]


def _head_dim(cfg: dict[str, Any]) -> int:
    if cfg.get("qk_nope_head_dim"):
        return int(cfg["qk_nope_head_dim"]) + int(cfg.get("qk_rope_head_dim") or 0)
    return int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])


def _layer_cost(cfg: dict[str, Any], width: float) -> ChunkCost:
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    return ChunkCost.from_shape(
        cfg["hidden_size"], int(width), cfg["num_attention_heads"], kv_heads, _head_dim(cfg)
    )


def _pairs(cfg: dict[str, Any], layer: int, prefix: int, n: int) -> tuple[float, float]:
    """(query-key pairs attended, pairs the indexer scores) of one chunk in one layer."""
    causal = prefix * n + n * (n + 1) / 2
    topk = int(cfg.get("index_topk") or 0)
    if cfg.get("model_type") == "deepseek_v4":
        # every query: its sliding window, plus compressed keys (CSA: top-k of them, chosen by
        # the indexer over all; HCA: all of them)
        kind = cfg["layer_types"][layer]
        compressed = causal / cfg["compress_rates"][kind]
        window = n * (cfg.get("sliding_window") or 0)
        if kind == "compressed_sparse_attention":
            return window + min(compressed, n * topk), compressed
        return window + compressed, 0.0
    if topk:  # V3.2: top-k keys a query, the indexer over every pair
        return min(causal, n * topk), causal
    return causal, 0.0


def prefill_flops(cfg: dict[str, Any], chunks: list[int]) -> float:
    """FLOPs of a lone prompt cut into `chunks` (the last token's logits included)."""
    _, top_k, _ = _experts(cfg)
    index_pair = 2.0 * (cfg.get("index_n_heads") or 0) * (cfg.get("index_head_dim") or 0)
    total = 0.0
    for layer, width in enumerate(_mlp_widths(cfg, float(top_k))):
        cost = _layer_cost(cfg, width)
        prefix = 0
        for n in chunks:
            attended, indexed = _pairs(cfg, layer, prefix, n)
            total += cost.token_cost * n + cost.pair_cost * attended + index_pair * indexed
            prefix += n
    return float(total + 2.0 * cfg["hidden_size"] * cfg["vocab_size"])


def prefill_distance(
    cfg: dict[str, Any], chunks: list[int], seconds: float, chips: int = 1
) -> dict[str, float]:
    """Achieved TFLOP/s (all chips) and its fraction of the chips' bf16 and FP8 rates."""
    tflops = prefill_flops(cfg, chunks) / seconds / 1e12
    return {
        "tflops": round(tflops, 1),
        "of_bf16": round(tflops / (chips * H200_BF16_TFLOPS), 3),
        "of_fp8": round(tflops / (chips * H200_FP8_TFLOPS), 3),
    }


def kv_bytes_per_token(cfg: dict[str, Any], kv_bytes: float) -> float:
    """KV bytes one token holds over all layers (kv_bytes per element: 2 bf16, 1 FP8)."""
    if cfg.get("kv_lora_rank"):  # MLA: the latent and its rope part
        per_layer = cfg["kv_lora_rank"] + (cfg.get("qk_rope_head_dim") or 0)
    elif cfg.get("model_type") == "deepseek_v4":  # one head_dim vector (before compression)
        per_layer = cfg["head_dim"]
    else:
        per_layer = 2 * (cfg.get("num_key_value_heads") or 1) * _head_dim(cfg)
    return float(per_layer) * float(cfg["num_hidden_layers"]) * kv_bytes


def decode_bytes(
    cfg: dict[str, Any], rows: int, context: int, weight_bytes: float, kv_bytes: float
) -> dict[str, float]:
    """Bytes one decode step of `rows` rows at `context` tokens each reads: the weights it
    touches (routed experts any row picked, expected under uniform routing) and the KV."""
    routed, top_k, _ = _experts(cfg)
    touched = routed * (1 - (1 - top_k / routed) ** rows) if routed else 0.0
    params = 0.0
    for width in _mlp_widths(cfg, touched):
        # linear weights only; norms are noise. ChunkCost counts 2 FLOPs per weight.
        params += _layer_cost(cfg, width).token_cost / 2
    params += 2.0 * cfg["hidden_size"] * cfg["vocab_size"]  # embedding row + lm head
    kv = kv_bytes_per_token(cfg, kv_bytes) * rows * context
    return {"weights": params * weight_bytes, "kv": kv}


def decode_distance(
    cfg: dict[str, Any],
    rows: int,
    context: int,
    step_s: float,
    weight_bytes: float = 2.0,
    kv_bytes: float = 2.0,
) -> dict[str, float]:
    """Bytes a step reads (GB) and that rate's fraction of the HBM bandwidth."""
    b = decode_bytes(cfg, rows, context, weight_bytes, kv_bytes)
    total = b["weights"] + b["kv"]
    return {
        "weights_gb": round(b["weights"] / 1e9, 3),
        "kv_gb": round(b["kv"] / 1e9, 3),
        "of_hbm": round(total / step_s / (H200_HBM_TBS * 1e12), 3),
    }
