"""DeepSeek-V3.2 (DSA) stage on CUDA == the same stage on CPU (which CI holds to transformers):
chunked prefill whose later chunks select over the whole prefix, then a batch of grouped decode
rows (their prefixes copied from block tables in one pinned transfer) beside a chunk. fp32 with
the torch backends, so any difference is the model's device handling, not a kernel's rounding.
"""

from __future__ import annotations

import pytest
import torch

from stages.forward_batch import ForwardBatch
from stages.kernels import flash_mla
from stages.kernels.registry import select_kernels
from stages.kv_cache import make_kv_cache
from stages.loader import build_stage_model
from stages.model_config import ModelArgs

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TINY_V32 = {
    "model_type": "deepseek_v32", "vocab_size": 200, "hidden_size": 64, "intermediate_size": 96,
    "moe_intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
    "num_key_value_heads": 4, "kv_lora_rank": 32, "q_lora_rank": 24, "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 8, "num_experts_per_tok": 2,
    "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 4, "topk_group": 2,
    "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "index_topk": 8,
    "index_n_heads": 8, "index_head_dim": 16, "bos_token_id": 1, "eos_token_id": 2,
}


def _run(device: str, weights: dict | None = None) -> tuple[list[torch.Tensor], dict]:
    """Logits of each forward, and the weights (random init draws on the parameter's device, so
    the CUDA run takes the CPU run's)."""
    args = ModelArgs.from_hf_dict(TINY_V32)
    kernels = select_kernels(device, linear="torch", attention="torch", mla_decode="torch",
                             moe_experts="torch", mla_sparse="torch", indexer_logits="torch")
    model = build_stage_model(args, None, 0, 3, True, True, kernels, torch.float32, device, 3)
    if weights is not None:
        model.load_state_dict(weights)
    kv = make_kv_cache(args, 3, 24, 4, torch.float32, device)
    g = torch.Generator().manual_seed(1)
    a, b, c = (torch.randint(3, 200, (n,), generator=g).tolist() for n in (30, 23, 10))
    ta, tb, tc = [9, 2, 17, 4, 11, 0, 20, 6], [1, 15, 8, 22, 3, 18], [5, 12, 23]
    out = []

    def forward(ids, rows):
        batch = ForwardBatch.build(rows, 4, device)
        h = model(torch.tensor(ids, device=device), batch, kv)
        out.append(model.compute_logits(h[batch.sample_indices]).cpu())

    for start in range(0, 28, 7):  # chunks of 7 over non-consecutive blocks
        forward(a[start:start + 7], [(start, 7, ta, True)])
    forward(b[:12], [(0, 12, tb, True)])
    forward(b[12:21], [(12, 9, tb, True)])
    # two decode rows of one decode group (prefixes of 29 and 22 keys) beside c's first chunk
    for step in range(2):
        forward([a[28 + step], b[21 + step]] + (c if step == 0 else []),
                [(28 + step, 1, ta, True), (21 + step, 1, tb, True)]
                + ([(0, 10, tc, True)] if step == 0 else []))
    return out, model.state_dict()


def test_dsa_stage_on_cuda_matches_cpu():
    cpu, weights = _run("cpu")
    cuda, _ = _run("cuda", weights)
    for c, g in zip(cpu, cuda):
        assert (c - g).abs().max().item() <= 1e-3


# FlashMLA's shapes: a 576-wide latent (512 + 64 rope); 16 query heads (zero-padded to 64 by
# the wrapper); prompts past index_topk so the indexer selects.
FLASH_V32 = dict(TINY_V32, hidden_size=512, num_attention_heads=16, num_key_value_heads=16,
                 kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                 q_lora_rank=256, num_hidden_layers=1, first_k_dense_replace=1, index_topk=128,
                 index_n_heads=8, index_head_dim=128, vocab_size=500)


def _logits_bf16(mla_sparse: str, device: str = "cuda") -> torch.Tensor:
    torch.manual_seed(0)
    args = ModelArgs.from_hf_dict(FLASH_V32)
    # the indexer on torch in both runs: identical selections, so only the MLA kernel differs
    kernels = select_kernels(device, mla_sparse=mla_sparse, indexer_logits="torch")
    model = build_stage_model(args, None, 0, 1, True, True, kernels, torch.bfloat16, device, 1)
    kv = make_kv_cache(args, 1, 16, 64, torch.bfloat16, device)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 500, (400,), generator=g).tolist()
    out = []
    for start in range(0, 384, 128):  # later chunks select 128 of up to 384 keys
        batch = ForwardBatch.build([(start, 128, list(range(8)), True)], 64, device)
        h = model(torch.tensor(ids[start:start + 128], device=device), batch, kv)
        out.append(model.compute_logits(h[batch.sample_indices]).float().cpu())
    for pos in (384, 385):  # decode rows
        batch = ForwardBatch.build([(pos, 1, list(range(8)), True)], 64, device)
        h = model(torch.tensor([ids[pos]], device=device), batch, kv)
        out.append(model.compute_logits(h[batch.sample_indices]).float().cpu())
    return torch.cat(out)


@pytest.mark.skipif(not flash_mla.is_available("cuda"), reason="needs sgl-flash-mla on SM90")
def test_dsa_on_flash_mla_sparse_matches_torch_kernels():
    flash, ref = _logits_bf16("flash-mla"), _logits_bf16("torch")
    assert ((flash - ref).norm() / ref.norm()).item() < 2e-2


def test_fp8_cache_indexer_scores_on_triton_match_the_reference():
    """A V3.2 stage with the FP8 cache on CUDA (keys quantized on write by the Triton kernel),
    its indexer on the Triton rows kernel: every call's scores (chunks over up to 384 FP8 keys,
    then decode rows) against the torch reference on the same pages, through the stage's own
    plans. 16 index heads: the decode kernel's least."""
    import dataclasses

    from stages.kernels import triton_indexer
    from stages.kernels.indexer_select import group_maxima, logits_rows_reference

    calls = []

    def checked(q, keys, weights, scale, plan, maxima=None):
        out = triton_indexer.indexer_logits_rows(q, keys, weights, scale, plan, maxima=maxima)
        ref = logits_rows_reference(q.float(), keys, weights, scale, plan)
        seen = ref != float("-inf")
        calls.append((keys.dtype, keys.shape[-1], torch.equal(out == float("-inf"), ~seen),
                      ((out[seen] - ref[seen]).norm() / ref[seen].norm()).item()))
        if maxima is not None:  # the kernel's group maxima are its own scores'
            assert torch.equal(maxima, group_maxima(out, torch.empty_like(maxima)))
        return out

    torch.manual_seed(0)
    args = ModelArgs.from_hf_dict(dict(FLASH_V32, index_n_heads=16))
    kernels = select_kernels("cuda", mla_sparse="torch", mla_sparse_fp8="torch")
    kernels = dataclasses.replace(kernels, indexer_logits_rows=checked)
    model = build_stage_model(args, None, 0, 1, True, True, kernels, torch.bfloat16, "cuda", 1)
    kv = make_kv_cache(args, 1, 16, 64, torch.bfloat16, "cuda", "fp8")
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 500, (400,), generator=g).tolist()
    steps = [(start, 128) for start in range(0, 384, 128)] + [(384, 1), (385, 1)]
    for start, n in steps:
        batch = ForwardBatch.build([(start, n, list(range(8)), True)], 64, "cuda")
        h = model(torch.tensor(ids[start:start + n], device="cuda"), batch, kv)
        assert torch.isfinite(model.compute_logits(h[batch.sample_indices])).all()
    assert len(calls) == 4  # the first chunk sees at most index_topk keys: no scores
    for dtype, width, same_unseen, err in calls:
        assert dtype == torch.uint8 and width == 132 and same_unseen
        assert err < 2e-3, err
