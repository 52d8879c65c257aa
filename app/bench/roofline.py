"""Distance to the hardware of the suite's rows: prefill TFLOP/s against the H200's measured
bf16 and FP8 GEMM rates (the H100's die and tensor rates are the same), decode bytes per step
against the chip's HBM bandwidth (model_cost.HBM_TBS).

The counts are the model's own (app/model_cost.py), the same the live server exports as
ray_ppserve_model_flops_total and ray_ppserve_decode_read_bytes_total; so are the rates.
"""

from __future__ import annotations

from typing import Any

from app.model_cost import (
    H200_BF16_TFLOPS,
    H200_FP8_TFLOPS,
    H200_HBM_TBS,
    HBM_TBS,
    decode_bytes,
    kv_bytes_per_token,
    prefill_flops,
)

__all__ = [
    "H200_BF16_TFLOPS",
    "H200_FP8_TFLOPS",
    "H200_HBM_TBS",
    "HBM_TBS",
    "decode_bytes",
    "decode_distance",
    "kv_bytes_per_token",
    "prefill_distance",
    "prefill_flops",
]


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


def decode_distance(
    cfg: dict[str, Any],
    rows: int,
    context: int,
    step_s: float,
    weight_bytes: float = 2.0,
    kv_bytes: float = 2.0,
    expert_bytes: float | None = None,
    hbm_tbs: float = H200_HBM_TBS,
) -> dict[str, float]:
    """Bytes a step reads (GB) and that rate's fraction of the HBM bandwidth, hbm_tbs (routed
    experts at expert_bytes a value where they are held otherwise: model_cost.expert_bytes_held)."""
    b = decode_bytes(cfg, rows, context, weight_bytes, kv_bytes, expert_bytes)
    total = b["weights"] + b["kv"]
    return {
        "weights_gb": round(b["weights"] / 1e9, 3),
        "kv_gb": round(b["kv"] / 1e9, 3),
        "of_hbm": round(total / step_s / (hbm_tbs * 1e12), 3),
    }
