"""DeepSeek-V3.2 sparse attention (DSA) specifics, against transformers' DeepseekV32ForCausalLM:
the reference's own cached generation, the indexer actually dropping keys, the config. Logits of
chained shards, chunked prefill and decode run in test_deepseek_vs_hf over the DSA checkpoints."""

from __future__ import annotations

import pytest
import torch

from stages.kernels import torch_ref
from stages.kv_cache import bytes_per_token_layer
from stages.model_config import ModelArgs
from stages.models.deepseek_config import IndexerArgs
from tests.cpu.conftest import DSA_SPARSE_TOPK, hf_model, write_tiny_checkpoint
from tests.cpu.test_shards_vs_hf import PROMPT, TOL, Pipeline

LONG = PROMPT + PROMPT[::-1][:17]  # 40 tokens: five times the sparse checkpoint's index_topk


def test_reference_caches_as_it_attends_whole():
    """transformers' V3.2 over its cache (chunks, then greedy generate) equals its own full-
    sequence forward, so its generate is a fair oracle for chunked prefill and decode."""
    from transformers import DynamicCache

    model = hf_model("ds_v32_sparse")
    ids = torch.tensor([LONG])
    with torch.no_grad():
        full = model(ids).logits[0]
        cache = DynamicCache(config=model.config)
        chunks = [model(ids[:, a:a + 7], cache=cache, use_cache=True).logits[0]
                  for a in range(0, len(LONG), 7)]
        assert (torch.cat(chunks) - full).abs().max().item() <= TOL
        # the mask given: generate would take the prompt's token 0 for padding
        generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5,
                                   do_sample=False, eos_token_id=None, pad_token_id=0
                                   )[0, len(LONG):].tolist()
        seq = list(LONG)
        for _ in range(5):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    assert generated == seq[len(LONG):]


def test_indexer_drops_keys(tmp_path, monkeypatch):
    """With index_topk below the prompt, each query past the first index_topk attends to exactly
    index_topk of its earlier keys, chosen by content (not a window); and that choice changes
    the output: transformers' logits on the same weights with a dense index_topk differ."""
    path = write_tiny_checkpoint(tmp_path, "ds_v32_sparse")
    calls = []
    real = torch_ref.mla_sparse

    def recording(q, kv, indices, dv, scale):
        calls.append(indices.clone())
        return real(q, kv, indices, dv, scale)

    monkeypatch.setattr(torch_ref, "mla_sparse", recording)
    pipe = Pipeline(path, num_stages=2, block_size=4, num_blocks=10)
    n = len(LONG)
    got = pipe.logits(LONG, [(0, n, list(range(10)), True)], all_positions=True)
    assert len(calls) == 4  # one call per layer, every row of the batch in it
    windows = 0
    for indices in calls:
        assert indices.shape == (n, DSA_SPARSE_TOPK) and indices.dtype == torch.int32
        for t, row in enumerate(indices.tolist()):
            keys = sorted(k for k in row if k >= 0)  # slots == positions: table 0, 1, 2...
            assert keys == sorted(set(keys)) and all(k <= t for k in keys)
            assert len(keys) == min(t + 1, DSA_SPARSE_TOPK)
            windows += keys == list(range(t + 1 - len(keys), t + 1))
    assert windows < len(calls) * (n - DSA_SPARSE_TOPK)  # not merely the most recent keys

    sparse = hf_model("ds_v32_sparse")
    dense = hf_model("ds_v32_sparse")
    for layer in dense.model.layers:
        layer.self_attn.indexer.index_topk = 64
    with torch.no_grad():
        want = sparse(torch.tensor([LONG])).logits[0]
        unselected = dense(torch.tensor([LONG])).logits[0]
    assert (got - want).abs().max().item() <= TOL
    first = DSA_SPARSE_TOPK  # queries that see at most index_topk keys attend alike
    assert (want[:first] - unselected[:first]).abs().max().item() <= TOL
    assert (want[first:] - unselected[first:]).abs().max().item() > 100 * TOL


def test_v32_config_and_cache_bytes():
    """transformers' V3.2 defaults (the real model's shapes) parse into the indexer's shape;
    its key joins the latent in the bytes per token; configs ppserve cannot serve are refused."""
    from transformers import DeepseekV32Config

    cfg = DeepseekV32Config().to_dict()
    args = ModelArgs.from_hf_dict(cfg)
    d = args.family_args
    assert d.indexer == IndexerArgs(topk=2048, n_heads=64, head_dim=128)
    assert (d.version, d.rope_interleave, d.first_k_dense_replace) == ("v3", True, 3)
    assert bytes_per_token_layer(args, torch.bfloat16) == (512 + 64 + 128) * 2
    assert ModelArgs.from_hf_dict({**cfg, "rope_interleave": False}).family_args.rope_interleave
    with pytest.raises(ValueError, match="q_lora_rank"):
        ModelArgs.from_hf_dict({**cfg, "q_lora_rank": None})
    with pytest.raises(ValueError, match="mlp_layer_types"):
        ModelArgs.from_hf_dict({**cfg, "mlp_layer_types": ["sparse"] * 61})
    with pytest.raises(ValueError, match="index_head_dim"):
        ModelArgs.from_hf_dict({**cfg, "index_head_dim": 32})
    v3 = ModelArgs.from_hf_dict({**cfg, "model_type": "deepseek_v3"})
    assert v3.family_args.indexer is None
    assert bytes_per_token_layer(v3, torch.bfloat16) == 576 * 2
