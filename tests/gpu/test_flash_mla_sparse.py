"""FlashMLA's SM90 sparse kernels (DeepSeek-V3.2) against the torch reference (fp32 on the same
inputs): the bf16 sparse prefill, used for every DSA row, and the sparse decode over the FP8
latent layout. Tolerance: relative Frobenius error < 1e-2 (bf16); the FP8 case compares with the
reference over the dequantized cache, so quantization error is not counted.
"""

from __future__ import annotations

import pytest
import torch

from stages.kernels import flash_mla, fp8_latent, torch_ref

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not flash_mla.is_available("cuda"), reason="needs sgl-flash-mla on SM90"),
]
TOL = 1e-2
SCALE = 192 ** -0.5


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "unwritten or non-finite output"
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def causal_indices(positions: torch.Tensor, topk: int, g: torch.Generator) -> torch.Tensor:
    """Per query at position p, min(topk, p + 1) distinct random keys of 0..p, padded with -1."""
    scores = torch.rand(len(positions), int(positions.max()) + 1, generator=g, device="cuda")
    keys = torch.arange(scores.shape[1], device="cuda")
    scores = scores.masked_fill(keys[None, :] > positions[:, None], -1.0)
    k = min(topk, scores.shape[1])
    val, idx = scores.topk(k, dim=-1)
    idx = idx.int().masked_fill(val < 0, -1)
    if k < topk:
        idx = torch.cat((idx, idx.new_full((len(positions), topk - k), -1)), dim=-1)
    return idx


@pytest.mark.parametrize("heads", [16, 64, 128])
@pytest.mark.parametrize("s_kv,topk", [(8192, 2048), (700, 100), (4096, 2048)])
def test_sparse_prefill_matches_reference(heads, s_kv, topk):
    g = torch.Generator(device="cuda").manual_seed(heads * 7 + topk)
    kv = (torch.randn(s_kv, 1, 576, generator=g, device="cuda") / 4).bfloat16()
    positions = torch.randint(0, s_kv, (192,), generator=g, device="cuda")
    positions[:3] = torch.tensor([0, 1, s_kv - 1], device="cuda")  # one key; all keys
    q = torch.randn(len(positions), heads, 576, generator=g, device="cuda").bfloat16()
    indices = causal_indices(positions, topk, g)
    out = flash_mla.mla_sparse(q, kv, indices, 512, SCALE)
    ref = torch_ref.mla_sparse(q.float(), kv.float(), indices, 512, SCALE)
    assert out.shape == (len(positions), heads, 512)
    assert rel_err(out, ref) < TOL


def test_sparse_prefill_row_without_keys_is_zero():
    g = torch.Generator(device="cuda").manual_seed(3)
    kv = torch.randn(256, 1, 576, generator=g, device="cuda").bfloat16()
    q = torch.randn(4, 64, 576, generator=g, device="cuda").bfloat16()
    indices = torch.full((4, 64), -1, dtype=torch.int32, device="cuda")
    indices[1:, 0] = 5
    out = flash_mla.mla_sparse(q, kv, indices, 512, SCALE)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert rel_err(out[1:], torch_ref.mla_sparse(q[1:].float(), kv.float(), indices[1:], 512,
                                                 SCALE)) < TOL


@pytest.mark.parametrize("heads", [16, 64, 128])
@pytest.mark.parametrize("rows,s_kv,topk", [(64, 16384, 2048), (512, 4096, 2048), (5, 300, 64)])
def test_sparse_fp8_decode_matches_reference(heads, rows, s_kv, topk):
    g = torch.Generator(device="cuda").manual_seed(heads + rows)
    block = 64
    blocks = -(-s_kv // block) + 3
    latent = (torch.randn(blocks * block, 576, generator=g, device="cuda") / 4).bfloat16()
    pages = fp8_latent.quantize(latent).view(blocks, block, 1, fp8_latent.BYTES)
    # Each row's keys live in shuffled blocks: slot ids go through a block table.
    perm = torch.randperm(blocks, generator=g, device="cuda")
    positions = torch.randint(0, s_kv, (rows,), generator=g, device="cuda")
    logical = causal_indices(positions, topk, g)
    slots = perm[(logical.clamp_min(0) // block).long()] * block + logical.clamp_min(0) % block
    indices = torch.where(logical >= 0, slots.int(), -1)
    q = torch.randn(rows, heads, 576, generator=g, device="cuda").bfloat16()
    state: dict = {}
    out = flash_mla.mla_sparse_fp8_decode(q, pages, indices, 512, SCALE, state)
    dequant = fp8_latent.dequantize(pages.view(-1, fp8_latent.BYTES)).view(-1, 1, 576)
    ref = torch_ref.mla_sparse(q.float(), dequant.float(), indices, 512, SCALE)
    assert out.shape == (rows, heads, 512)
    assert rel_err(out, ref) < TOL
    again = flash_mla.mla_sparse_fp8_decode(q, pages, indices, 512, SCALE, state)  # plan reused
    assert torch.equal(again, out)
