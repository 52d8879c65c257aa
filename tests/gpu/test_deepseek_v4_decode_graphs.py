"""DeepSeek-V4 decode-only microbatches captured as CUDA graphs (V4Plan.paged; FlashMLA's V4
attention, bf16 over the gathered keys or FP8 over the pages in place; the Triton indexer, MoE
and hyper-connections): each replay's logits equal the same static buffers run eagerly and
agree with the general ForwardBatch path, with rows crossing the window, both rates' group
boundaries and the indexer's top-k, a bucket padded with 3 rows; with FP8 weights and the FP8
KV pages; and through the engine, graphed greedy tokens equal --enforce-eager's."""

from __future__ import annotations

import pytest
import torch

from stages.kernels import flash_mla
from stages.kernels.registry import select_kernels
from stages.model_config import ModelArgs
from stages.models.families import DEEPSEEK_V4, GraphSetting
from tests.cpu.test_deepseek_paged_decode import decode_case
from tests.gpu.test_deepseek_decode_graphs import graphed_and_eager_tokens, ray_gpu  # noqa: F401

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not flash_mla.is_available(), reason="needs CUDA SM90 and sgl-flash-mla"),
]

# V4-Flash's attention shapes (head dim 512 with 64 rope channels, window 128, rates 4 and 128,
# index heads of 128) at a small width; 16 query heads, which FlashMLA pads to 64
FLASH_V4 = {
    "model_type": "deepseek_v4", "vocab_size": 500, "hidden_size": 512,
    "moe_intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 16,
    "num_key_value_heads": 1, "head_dim": 512, "q_lora_rank": 256,
    "partial_rotary_factor": 0.125, "qk_rope_head_dim": 64, "num_experts_per_tok": 2,
    "n_routed_experts": 8, "n_shared_experts": 1, "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True, "routed_scaling_factor": 1.5,
    "layer_types": ["sliding_attention", "compressed_sparse_attention",
                    "heavily_compressed_attention", "compressed_sparse_attention"],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"], "hc_mult": 4, "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6, "swiglu_limit": 10.0, "sliding_window": 128, "o_groups": 2,
    "o_lora_rank": 128, "index_n_heads": 16, "index_head_dim": 128, "index_topk": 64,
    "max_position_embeddings": 4096, "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
    "rms_norm_eps": 1e-6, "bos_token_id": 0, "eos_token_id": 1,
}  # fmt: skip
# row 127 completes rate 128's first group at once, row 250 at step 5 and passes 64 rate-4
# entries (top-k) at step 9; row 300 selects throughout; rows 5 and 3 within the window
LENGTHS = (5, 127, 300, 3, 250)
STEPS = 12


@pytest.mark.parametrize(
    "fp8_weights,kv_cache_dtype",
    [(False, "auto"), (True, "auto"), (False, "fp8"), (True, "fp8")],
    ids=["bf16", "fp8_weights", "fp8_kv", "fp8_both"],
)
def test_v4_graphed_decode_equals_eager_and_the_general_path(fp8_weights, kv_cache_dtype):
    args = ModelArgs.from_hf_dict(FLASH_V4)
    kernels = select_kernels(
        "cuda", linear="torch", attention="torch", fp8_linear="auto" if fp8_weights else None
    )
    assert DEEPSEEK_V4.paged_decode_graphs(
        GraphSetting(kernels.names, 128, kv_cache_dtype, "bfloat16")
    ), kernels.names
    steps = decode_case(
        args, kernels, torch.bfloat16, "cuda", 128, 512, LENGTHS, STEPS, True, kv_cache_dtype
    )
    for key, ref, eager, graphed in steps:
        assert graphed is not None and key == (8, 512)
        assert torch.equal(graphed, eager), (key, (graphed - eager).abs().max().item())
        scale = ref.abs().max().item()
        assert (graphed - ref).abs().max().item() <= 0.05 * scale, key
        assert (graphed.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.8


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_engine_graphs_v4_decode(ray_gpu, tmp_path, fp8):  # noqa: F811
    formats = {"quantization": "fp8", "kv_cache_dtype": "fp8"} if fp8 else {}
    outs = graphed_and_eager_tokens(tmp_path, FLASH_V4, 128, (512,), **formats)
    assert outs[False] == outs[True]
