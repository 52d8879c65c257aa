"""DeepSeek-V3.2's FP8 indexer key (values in e4m3, one power-of-two float32 scale per token): the
round trip within e4m3 precision, the quantize-on-write's torch path, and the indexer's scores
over FP8 keys (the torch reference, the one CPU stages run) against the same scores over the
unquantized keys: close, and the same top-k where the keys' scores are well apart."""

from __future__ import annotations

import torch

from stages.kernels import fp8_indexer, fp8_latent, triton_fp8_latent
from stages.kernels.indexer_select import logits_rows_reference, topk_slots
from tests.select_rows import decode_plan


def test_round_trip_within_e4m3_precision():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 128, generator=g) * torch.logspace(-3, 2, 37)[:, None]
    packed = fp8_indexer.quantize(x.bfloat16())
    assert packed.shape == (37, 132) and packed.dtype == torch.uint8
    scale = packed[:, 128:].contiguous().view(torch.float32)[:, 0]
    assert torch.equal(torch.log2(scale), torch.log2(scale).round())  # powers of two
    amax = x.bfloat16().float().abs().amax(-1)
    assert (amax / scale <= fp8_latent.FP8_MAX).all() and (
        amax / scale > fp8_latent.FP8_MAX / 2
    ).all()
    back = fp8_indexer.dequantize(packed)
    err = (back - x.bfloat16().float()).abs()
    # 3 mantissa bits: half a unit in the last place is at most 1/16 of a value
    assert (err <= x.abs() / 16 + amax[:, None] * 2**-9).all()
    exact = torch.zeros(2, 64)
    exact[0, :3] = torch.tensor([3.0, -0.75, 1.5])
    exact[1, 5] = -1024.0
    assert torch.equal(fp8_indexer.dequantize(fp8_indexer.quantize(exact)), exact)


def test_write_stores_the_quantized_keys_at_their_slots():
    g = torch.Generator().manual_seed(1)
    keys = torch.randn(5, 64, generator=g)
    flat = torch.full((12, 68), 7, dtype=torch.uint8)
    slots = torch.tensor([9, 0, 4, 11, 2])
    triton_fp8_latent.write_indexer_key(flat, keys, slots)
    assert torch.equal(flat[slots], fp8_indexer.quantize(keys))
    untouched = [s for s in range(12) if s not in slots.tolist()]
    assert (flat[untouched] == 7).all()


def test_scores_over_fp8_keys_match_and_select_the_same_keys():
    """Chunk rows and decode rows over a shuffled cache: every key a positive multiple of one
    direction (15 % apart in rank order) plus small noise, so the top-k is well separated; the
    scores over the FP8 keys are those of the dequantized keys and the FP8-rounded queries
    (fp8_indexer.quantize_queries) exactly, and close to the bf16 keys' and queries'."""
    g = torch.Generator().manual_seed(2)
    heads, dim, n_keys, topk = 4, 64, 150, 16
    u = torch.randn(dim, generator=g)
    magnitude = 1.15 ** (torch.randperm(n_keys, generator=g).float() - n_keys / 2)
    keys = (magnitude[:, None] * u + 0.01 * torch.randn(n_keys, dim, generator=g)).bfloat16()
    shapes = [(1, 40), (20, 30), (1, 50)]  # (tokens, first position): decode, chunk, decode
    slots = torch.randperm(n_keys, generator=g)
    rows, off, used = [], 0, 0
    for n, start in shapes:
        rows.append((off, n, start, slots[used : used + start + n]))
        off, used = off + n, used + start + n
    plan = decode_plan(rows, "cpu")
    q = (u + 0.1 * torch.randn(off, heads, dim, generator=g)).bfloat16()
    w = torch.rand(off, heads, generator=g) + 0.5
    packed = fp8_indexer.quantize(keys)
    scale = dim**-0.5
    got = logits_rows_reference(q, packed, w, scale, plan)
    dequantized = fp8_indexer.dequantize(packed)
    q8, q_scale = fp8_indexer.quantize_queries(q)
    rounded = q8.float() * q_scale[..., None]
    assert torch.equal(got, logits_rows_reference(rounded, dequantized, w, scale, plan))
    want = logits_rows_reference(q, keys, w, scale, plan)
    seen = want != float("-inf")
    assert torch.equal(got != float("-inf"), seen)
    assert ((got[seen] - want[seen]).norm() / want[seen].norm()).item() < 0.03
    assert torch.equal(
        topk_slots(got, plan, topk).sort(dim=-1).values,
        topk_slots(want, plan, topk).sort(dim=-1).values,
    )
