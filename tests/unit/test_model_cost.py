"""The model work the server counts per microbatch (app/model_cost.py), against hand arithmetic
for tiny configs; the bench's prefill count is the same sum."""

import pytest

from app.config import EngineConfig
from app.model_cost import ModelCost, PeakRates, prefill_flops
from stages.model_config import BUILTIN_CONFIG
from stages.protocol import Row

# BUILTIN_CONFIG: hidden 128, MLP 256, 4 heads of 32, 2 KV heads, 4 layers, vocab 320
LAYERS, VOCAB, HIDDEN = 4, 320, 128
WEIGHTS = 128 * 4 * 32 + 2 * 128 * 2 * 32 + 4 * 32 * 128 + 3 * 128 * 256  # one layer's linears
TOKEN = 2 * WEIGHTS  # FLOPs a token, a layer
PAIR = 4 * 4 * 32  # FLOPs a query-key pair, a layer (scores and the weighted sum)
HEAD = 2 * HIDDEN * VOCAB  # the LM head, a sampled token


def row(start, n, sample=False, prefill=True):
    return Row("r", 0, start, n, None, sample=sample, is_prefill=prefill)


def test_prefill_step_counts_every_row_and_the_sampled_heads():
    cost = ModelCost(BUILTIN_CONFIG)
    rows = [row(0, 32), row(64, 16, sample=True), row(10, 1, sample=True, prefill=False)]
    pairs = 32 * 33 / 2 + (64 * 16 + 16 * 17 / 2) + 11  # a decode row at 10 sees 11 keys
    work = cost.step(rows)
    assert work.phase == "prefill" and work.weight_bytes == work.kv_bytes == 0
    assert work.flops == pytest.approx(LAYERS * (TOKEN * 49 + PAIR * pairs) + 2 * HEAD)


def test_decode_step_reads_the_weights_once_and_each_rows_keys():
    cost = ModelCost(BUILTIN_CONFIG, weight_bytes=2, kv_bytes=2)
    work = cost.step([row(10, 1, True, False), row(99, 1, True, False)])
    assert work.phase == "decode"
    assert work.flops == pytest.approx(LAYERS * (TOKEN * 2 + PAIR * (11 + 100)) + 2 * HEAD)
    params = LAYERS * WEIGHTS + 2 * HIDDEN * VOCAB  # the linears, embedding and head
    assert work.weight_bytes == params * 2
    kv_per_token = LAYERS * 2 * 2 * 32 * 2  # K and V of 2 heads of 32, 2 bytes
    assert work.kv_bytes == kv_per_token * (11 + 100)


def test_moe_decode_reads_the_experts_its_rows_pick():
    cfg = {"hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16,
           "num_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 2,
           "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
           "vocab_size": 100}
    attn = 32 * 2 * 16 + 2 * 32 * 1 * 16 + 2 * 16 * 32
    cost = ModelCost(cfg, weight_bytes=1)
    for rows, experts in ((1, 2), (3, 8 * (1 - 0.75**3))):  # expected under uniform routing
        step = cost.step([row(5 + i, 1, True, False) for i in range(rows)])
        want = 2 * (attn + 3 * 32 * 16 * experts) + 2 * 32 * 100
        assert step.weight_bytes == pytest.approx(want)
    # prefill computes top-k experts a token; one token, one pair, in each of 2 layers
    want = 2 * (2 * (attn + 3 * 32 * 16 * 2) + 4 * 2 * 16)
    assert cost.chunk_flops(0, 1) == pytest.approx(want)


def test_bench_prefill_count_is_the_servers_sum():
    chunks = [(0, 32), (32, 32), (64, 7)]
    steps = [ModelCost(BUILTIN_CONFIG).step([row(p, n, sample=p == 64)]) for p, n in chunks]
    assert sum(s.flops for s in steps) == pytest.approx(prefill_flops(BUILTIN_CONFIG, [32, 32, 7]))
    # however it is cut, a lone prompt's pairs are those of one causal square
    want = LAYERS * (TOKEN * 71 + PAIR * 71 * 72 / 2) + HEAD
    assert prefill_flops(BUILTIN_CONFIG, [71]) == pytest.approx(want)


def test_element_sizes_follow_the_engine_options():
    def sizes(**options):
        cost = ModelCost.for_engine(EngineConfig(**options), fp8_checkpoint=False)
        return cost.weight_bytes, cost.kv_per_token / (LAYERS * 2 * 2 * 32)

    assert sizes() == (4, 4)  # float32 on CPU
    assert sizes(device="cuda") == (2, 2)
    assert sizes(device="cuda", quantization="fp8", kv_cache_dtype="fp8") == (1, 1)
    assert sizes(quantization="fp8") == (4, 4)  # dequantized at load on CPU
    assert ModelCost.for_engine(EngineConfig(device="cuda"), fp8_checkpoint=True).weight_bytes == 1


def test_packed_mxfp4_experts_follow_the_engine_option(tmp_path):
    """A checkpoint whose routed experts are MXFP4 (DeepSeek-V4's expert_dtype fp4): the live
    counters read them at 17/32 bytes a value with --mxfp4-experts keep, else as the rest."""
    import json

    from app.bench.target import QWEN3_30B_A3B
    from app.model_cost import MXFP4_BYTES

    (tmp_path / "config.json").write_text(json.dumps(dict(QWEN3_30B_A3B, expert_dtype="fp4")))

    def cost(mode):
        return ModelCost.for_engine(
            EngineConfig(model=str(tmp_path), device="cuda", mxfp4_experts=mode), False
        )

    keep, wide = cost("keep"), cost("dequantize")
    assert keep.expert_bytes == MXFP4_BYTES and wide.expert_bytes is None
    assert keep.step_weight_bytes(512) < 0.35 * wide.step_weight_bytes(512)  # experts dominate


def test_peak_rates_default_to_an_h200():
    assert EngineConfig().peak_rates == PeakRates({"bf16": 790e12, "fp8": 1580e12}, 4.8e12)
    assert EngineConfig(peak_bf16_tflops=989.5).peak_rates.flops["bf16"] == 989.5e12
