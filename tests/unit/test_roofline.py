"""Distance to the hardware (app/bench/roofline.py): the counts against hand arithmetic."""

import pytest

from app.bench import roofline
from app.bench.target import LLAMA3_8B, QWEN3_30B_A3B


def test_llama8b_prefill_flops_by_hand():
    h, inter, heads, kv, hd, layers = 4096, 14336, 32, 8, 128, 32
    weights = h * (heads + 2 * kv) * hd + heads * hd * h + 3 * h * inter
    n = 8192
    chunks = [n, n]  # the second chunk sees the first as its prefix
    pairs = (n * (n + 1) / 2) + (n * n + n * (n + 1) / 2)
    want = layers * (2 * weights * 2 * n + 4 * heads * hd * pairs) + 2 * h * 128256
    assert roofline.prefill_flops(LLAMA3_8B, chunks) == pytest.approx(want)
    d = roofline.prefill_distance(LLAMA3_8B, chunks, 1.0, chips=2)
    assert d["of_bf16"] == pytest.approx(want / 1e12 / 1580, abs=1e-3)


def test_decode_reads_the_weights_once_and_every_rows_kv():
    b = roofline.decode_bytes(LLAMA3_8B, rows=64, context=1000, weight_bytes=2, kv_bytes=2)
    assert b["weights"] / 1e9 == pytest.approx(16.06, abs=0.01)  # 8.03B params in bf16
    assert b["kv"] == 64 * 1000 * 32 * 2 * 8 * 128 * 2
    half = roofline.decode_bytes(LLAMA3_8B, rows=64, context=1000, weight_bytes=1, kv_bytes=1)
    assert half["weights"] == b["weights"] / 2 and half["kv"] == b["kv"] / 2


def test_moe_decode_reads_more_experts_with_more_rows():
    one = roofline.decode_bytes(QWEN3_30B_A3B, 1, 100, 2, 2)["weights"]
    many = roofline.decode_bytes(QWEN3_30B_A3B, 512, 100, 2, 2)["weights"]
    assert 4e9 < one < 8e9 and 55e9 < many < 65e9  # ~3B active, ~30B in all


def test_packed_mxfp4_experts_read_at_their_bytes():
    """Routed experts kept MXFP4 (--mxfp4-experts keep) are read at 17/32 bytes a value, the
    rest at the weights' size; dequantized, or on a model without MXFP4 experts, nothing
    changes."""
    from app.model_cost import MXFP4_BYTES, expert_bytes_held, routed_expert_params

    fp4 = dict(QWEN3_30B_A3B, expert_dtype="fp4")
    assert expert_bytes_held(fp4, "keep") == MXFP4_BYTES == 17 / 32
    assert expert_bytes_held(fp4, "dequantize") is None
    assert expert_bytes_held(QWEN3_30B_A3B, "keep") is None
    rows = 512
    experts = routed_expert_params(fp4, rows)
    h, width, layers, routed = 2048, 768, 48, 128  # Qwen3-30B-A3B: every expert at 512 rows
    assert experts == pytest.approx(3 * h * width * layers * routed, rel=1e-6)
    wide = roofline.decode_bytes(fp4, rows, 100, 1, 1)["weights"]
    packed = roofline.decode_bytes(fp4, rows, 100, 1, 1, MXFP4_BYTES)["weights"]
    assert wide - packed == pytest.approx(experts * (1 - MXFP4_BYTES))
    d = roofline.decode_distance(fp4, rows, 100, 0.01, 1, 1, MXFP4_BYTES)
    assert d["weights_gb"] == pytest.approx(packed / 1e9, abs=1e-3)
