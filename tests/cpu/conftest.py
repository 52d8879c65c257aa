"""Shared helpers for torch tests: tiny random HF checkpoints written by transformers itself."""

from __future__ import annotations

import os

import pytest
import torch

ARCHS = ("llama", "llama3", "llama_tied", "qwen2", "qwen3")

_COMMON = dict(vocab_size=200, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
               rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
               initializer_range=0.1)  # larger than 0.02 so logits and RoPE effects are not tiny


def hf_config(arch: str):
    import transformers as tf
    if arch == "llama":
        return tf.LlamaConfig(**_COMMON, rope_theta=10000.0)
    if arch == "llama3":
        return tf.LlamaConfig(**_COMMON, rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    if arch == "llama_tied":
        return tf.LlamaConfig(**_COMMON, tie_word_embeddings=True)
    if arch == "qwen2":
        return tf.Qwen2Config(**_COMMON, rope_theta=1000000.0)
    if arch == "qwen3":
        return tf.Qwen3Config(**_COMMON, head_dim=16, rope_theta=1000000.0)
    raise ValueError(f"unknown arch {arch!r}; choose from {ARCHS}")


def hf_model(arch: str, seed: int = 0):
    import transformers as tf
    cls = {"qwen2": tf.Qwen2ForCausalLM, "qwen3": tf.Qwen3ForCausalLM}.get(arch,
                                                                          tf.LlamaForCausalLM)
    torch.manual_seed(seed)
    model = cls(hf_config(arch)).float().eval()
    with torch.no_grad():  # HF zero-inits biases; random ones make the qwen2 test meaningful
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.02)
    return model


def write_tiny_checkpoint(tmp_path, arch: str = "llama", seed: int = 0,
                          max_shard_size: str | int | None = None) -> str:
    """Save a tiny fp32 random HF model of `arch` under tmp_path/arch; returns the directory."""
    path = os.path.join(str(tmp_path), arch if max_shard_size is None else arch + "-sharded")
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    hf_model(arch, seed).save_pretrained(path, **kwargs)
    return path


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """arch -> checkpoint directory, written once per session."""
    root = tmp_path_factory.mktemp("ckpt")
    return {arch: write_tiny_checkpoint(root, arch) for arch in ARCHS}
