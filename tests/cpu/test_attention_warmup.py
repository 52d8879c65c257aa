"""The startup warm-up builds cuDNN's graphs for the very tensors a prefill chunk's attention
receives: cuDNN keys its graphs on shapes and strides, so the warm-up's zero Q/K/V must have
the model's (MLA's V is a view split off its K/V projection). The chunk attention of a real
stage is recorded and compared with stages.attention_warmup.zero_qkv for the family's dims."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from stages.attention_warmup import zero_qkv
from stages.forward_batch import ForwardBatch
from stages.kernels import torch_ref
from stages.kernels.registry import select_kernels
from stages.kv_cache import make_kv_cache
from stages.loader import build_stage_model
from stages.model_config import ModelArgs

V2 = {
    "model_type": "deepseek_v2", "vocab_size": 300, "hidden_size": 64,
    "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 32,
    "q_lora_rank": None, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 24,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
    "first_k_dense_replace": 1, "topk_method": "greedy", "n_group": 1, "topk_group": 1,
    "routed_scaling_factor": 1.0, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
    "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip
LLAMA = {
    "model_type": "llama", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip


def _recorded_chunk_attention(config: dict) -> tuple[ModelArgs, list[tuple[torch.Tensor, ...]]]:
    """The (q, k, v) of every chunk-attention call of a 2-chunk prompt's second chunk."""
    args = ModelArgs.from_hf_dict(config)
    calls: list[tuple[torch.Tensor, ...]] = []

    def attention(q, k, v, scale):
        calls.append((q, k, v))
        return torch_ref.attention(q, k, v, scale)

    kernels = dataclasses.replace(select_kernels("cpu"), attention=attention)
    layers = args.num_hidden_layers
    model = build_stage_model(args, None, 0, layers, True, True, kernels, torch.bfloat16, "cpu")
    kv = make_kv_cache(args, layers, 8, 16, torch.bfloat16, "cpu")
    ids = torch.randint(3, 300, (48,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        model(ids[:32], ForwardBatch.build([(0, 32, list(range(4)), False)], 16, "cpu"), kv)
        calls.clear()
        model(ids[32:], ForwardBatch.build([(32, 16, list(range(4)), True)], 16, "cpu"), kv)
    return args, calls


@pytest.mark.parametrize("config", [V2, LLAMA], ids=["mla", "gqa"])
def test_warm_up_tensors_have_the_models_shapes_and_strides(config):
    args, calls = _recorded_chunk_attention(config)
    assert calls, "the chunk's attention never reached the kernel"
    dims = args.family.chunk_attention_dims(args)
    assert dims is not None
    for q, k, v in calls:
        zq, zk, zv = zero_qkv(dims, q.shape[0], k.shape[0], q.dtype, q.device)
        for real, zero in ((q, zq), (k, zk), (v, zv)):
            assert real.shape == zero.shape and real.stride() == zero.stride()


def test_sparse_and_v4_families_have_no_dense_chunk_attention():
    from tests.deepseek_v4_ref import TINY_V4

    v32 = dict(V2, model_type="deepseek_v32", q_lora_rank=32, index_topk=8, index_n_heads=2,
               index_head_dim=16, topk_method="noaux_tc")  # fmt: skip
    for config in (v32, dict(TINY_V4, model_type="deepseek_v4")):
        args = ModelArgs.from_hf_dict(config)
        assert args.family.chunk_attention_dims(args) is None


@pytest.mark.parametrize("arch", ["v2", "v4"])
def test_experts_warm_up_calls_the_routed_kernel_at_each_chunk_length(arch):
    """Stage.warm_up_experts: the stage's routed-expert kernel once a chunk length, on zero
    rows of the hidden size with the router's picks (V4: its first score-routed layer, past the
    hash ones); a dense model has none to warm."""
    from tests.deepseek_v4_ref import TINY_V4

    config = V2 if arch == "v2" else dict(TINY_V4, model_type="deepseek_v4")
    args = ModelArgs.from_hf_dict(config)
    calls: list[tuple[int, ...]] = []
    base = select_kernels("cpu")

    def moe_experts(x, gate_up, down, ids, weights, **options):
        calls.append((*x.shape, *ids.shape))
        assert not x.any() and bool((ids >= 0).all())
        return base.moe_experts(x, gate_up, down, ids, weights, **options)

    kernels = dataclasses.replace(base, moe_experts=moe_experts)
    layers = args.num_hidden_layers
    model = build_stage_model(args, None, 0, layers, True, True, kernels, torch.bfloat16, "cpu")
    got = model.warm_up_experts([7, 16], torch.bfloat16, torch.device("cpu"))
    k = config["num_experts_per_tok"]
    assert calls == [(7, 64, 7, k), (16, 64, 16, k)] and got["expert_lengths"] == 2
    dense = build_stage_model(ModelArgs.from_hf_dict(LLAMA), None, 0, 2, True, True, base,
                              torch.bfloat16, "cpu")  # fmt: skip
    assert dense.warm_up_experts([7], torch.bfloat16, torch.device("cpu")) == {}
