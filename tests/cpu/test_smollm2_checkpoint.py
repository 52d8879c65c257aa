"""The downloaded SmolLM2 checkpoint: shapes from the GGUF metadata, bf16 weights, the chat
template and provenance, a sensible answer from transformers, and a cache hit the second time."""

from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open

from app.models_cache import MODELS, ensure_model
from tests.smollm2_ref import hf_greedy


def test_checkpoint_files(smollm2_dir):
    cfg = json.load(open(os.path.join(smollm2_dir, "config.json")))
    assert (cfg["model_type"], cfg["num_hidden_layers"], cfg["hidden_size"],
            cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"],
            cfg["tie_word_embeddings"]) == ("llama", 30, 576, 9, 3, 49152, True)
    with safe_open(os.path.join(smollm2_dir, "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
        assert len(names) == 1 + 30 * 9 + 1  # embeddings, 9 tensors a layer, final norm
        assert {f.get_tensor(n).dtype for n in names[:3]} == {torch.bfloat16}
    source = json.load(open(os.path.join(smollm2_dir, "ppserve_source.json")))
    assert source["wheel_sha256"] == MODELS["smollm2"].wheel_sha256


def test_transformers_answers_sensibly(smollm2_hf):
    model, tok = smollm2_hf
    assert "<|im_start|>assistant" in tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    ids = tok.encode("The capital of France is")
    assert tok.decode(hf_greedy(model, ids, 3)).startswith(" Paris")


def test_second_fetch_is_a_cache_hit(smollm2_dir, monkeypatch):
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # would fail if used
    before = os.stat(os.path.join(smollm2_dir, "model.safetensors")).st_mtime_ns
    assert str(ensure_model("smollm2")) == smollm2_dir
    assert os.stat(os.path.join(smollm2_dir, "model.safetensors")).st_mtime_ns == before
