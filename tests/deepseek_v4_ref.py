"""Tiny random DeepSeek-V4 checkpoints written by transformers (the oracle), for the CPU, Ray
and GPU tests: every layer type, hash and routed MoE, yarn on the compressed rotary, and every
parameter transformers initialises to a constant (sinks, biases, hash table) drawn at random."""

from __future__ import annotations

import torch

# Every layer type (sliding, CSA at rate 4 with top-3, HCA at rate 8), two hash layers then
# routed ones, a window of 8: a 40-token prompt spans five windows and ten CSA groups. Two
# indexer heads: a query often scores several entries exactly 0 (both heads' ReLU off), so the
# tie rule (stages.kernels.indexer_select.top_k_positions) decides which of them it keeps.
TINY_V4 = dict(
    vocab_size=128,
    hidden_size=64,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    head_dim=32,
    q_lora_rank=16,
    partial_rotary_factor=0.25,
    num_experts_per_tok=2,
    n_routed_experts=4,
    routed_scaling_factor=1.5,
    layer_types=[
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "compressed_sparse_attention",
    ],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
    hc_mult=2,
    sliding_window=8,
    o_groups=2,
    o_lora_rank=8,
    index_n_heads=2,
    index_head_dim=16,
    index_topk=3,
    swiglu_limit=0.5,
    max_position_embeddings=512,
    compress_rope_theta=1000.0,
    rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    bos_token_id=0,
    eos_token_id=1,
)

# A second shape: four streams, rates 2 and 16, sigmoid scores, tied embeddings, plain rope,
# biases on the shared expert, a window of 5, hash layers first and fourth (so a later stage
# routes by token id too).
SECOND_V4 = dict(
    vocab_size=96,
    hidden_size=48,
    moe_intermediate_size=24,
    num_hidden_layers=5,
    num_attention_heads=6,
    head_dim=16,
    q_lora_rank=12,
    partial_rotary_factor=0.5,
    num_experts_per_tok=3,
    n_routed_experts=6,
    routed_scaling_factor=2.0,
    scoring_func="sigmoid",
    layer_types=[
        "heavily_compressed_attention",
        "compressed_sparse_attention",
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
    ],
    compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 16},
    mlp_layer_types=["hash_moe", "moe", "moe", "hash_moe", "moe"],
    hc_mult=4,
    hc_sinkhorn_iters=7,
    sliding_window=5,
    o_groups=3,
    o_lora_rank=6,
    # a power of four: 4**-0.5 rides on the indexer's softmax scale (TINY_V4's two heads take
    # the head weights' cast and product)
    index_n_heads=4,
    index_head_dim=8,
    index_topk=4,
    swiglu_limit=1.0,
    mlp_bias=True,
    tie_word_embeddings=True,
    max_position_embeddings=256,
    bos_token_id=0,
    eos_token_id=1,
)


def randomize(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if name.endswith("tid2eid"):
                experts = model.config.n_routed_experts
                rows = [
                    torch.randperm(experts, generator=g)[: t.shape[1]] for _ in range(t.shape[0])
                ]
                t.copy_(torch.stack(rows))
            elif name.endswith("norm.weight"):
                t.copy_(1 + 0.1 * torch.randn(t.shape, generator=g))
            elif not t.is_floating_point():
                continue
            elif name.endswith(("sinks", "position_bias", "scale", "base")):
                t.copy_(0.5 * torch.randn(t.shape, generator=g))
            else:
                t.copy_(0.1 * torch.randn(t.shape, generator=g))


def write_checkpoint(path: str, overrides: dict, seed: int = 0) -> str:
    """transformers' model of `overrides` with randomize's weights, saved under `path`: a
    DeepSeek-V4 unless `overrides` names another model_type (the GPU tests' config.json dicts,
    e.g. tests/gpu/test_deepseek_decode_graphs.py's FLASH_V32)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(overrides)
    config = AutoConfig.for_model(fields.pop("model_type", "deepseek_v4"), **fields)
    model = AutoModelForCausalLM.from_config(config)
    randomize(model, seed)
    model.save_pretrained(path)
    return path


# V4-Flash's own rates, window and rotaries (CSA 4 with the indexer, HCA 128, window 128,
# compress_rope_theta 160000 with YaRN factor 16, transformers' default layer and hash
# patterns: two HCA then CSA/HCA alternating, three hash layers) at tiny widths; blocks of 128.
FLASH_LIKE_V4 = dict(
    vocab_size=160,
    hidden_size=64,
    moe_intermediate_size=32,
    num_hidden_layers=6,
    num_attention_heads=8,
    head_dim=64,
    q_lora_rank=32,
    num_experts_per_tok=3,
    n_routed_experts=8,
    o_groups=4,
    o_lora_rank=16,
    index_n_heads=8,
    index_head_dim=32,
    index_topk=16,
    max_position_embeddings=4096,
    rope_parameters={
        "rope_type": "yarn",
        "factor": 16.0,
        "original_max_position_embeddings": 256,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    bos_token_id=0,
    eos_token_id=1,
)


def write_fp8_copy(path: str, stage, dest: str) -> str:  # type: ignore[no-untyped-def]
    """The checkpoint at `path` rewritten under `dest` with every tensor `stage` keeps in FP8
    stored quantized (e4m3 with its 128 x 128 `weight_scale_inv`, DeepSeek's names, pieces of
    fused or stacked parameters each on its own) and the quantization_config saying so."""
    import json
    import os

    from safetensors.torch import load_file, save_file

    from stages.kernels import fp8_ref
    from stages.kernels.fp8_ref import SCALE_SUFFIX

    sources = stage.checkpoint_sources()
    kept = [n for n, p in stage.named_parameters() if p.dtype == fp8_ref.FP8]
    tensors = load_file(os.path.join(path, "model.safetensors"))
    for name in {piece.name for n in kept for piece in sources[n]}:
        tensors[name], tensors[name + SCALE_SUFFIX] = fp8_ref.quantize_weight(tensors[name])
    save_file(tensors, os.path.join(dest, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    with open(os.path.join(dest, "config.json"), "w") as f:
        json.dump(config, f)
    return dest
