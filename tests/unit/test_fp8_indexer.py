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
    values, scale = fp8_indexer.quantize(x.bfloat16())
    assert values.dtype == torch.float8_e4m3fn and scale.shape == (37,)
    assert torch.equal(torch.log2(scale), torch.log2(scale).round())  # powers of two
    amax = x.bfloat16().float().abs().amax(-1)
    assert (amax / scale <= fp8_latent.FP8_MAX).all() and (
        amax / scale > fp8_latent.FP8_MAX / 2
    ).all()
    back = fp8_indexer.dequantize(values, scale)
    err = (back - x.bfloat16().float()).abs()
    # 3 mantissa bits: half a unit in the last place is at most 1/16 of a value
    assert (err <= x.abs() / 16 + amax[:, None] * 2**-9).all()
    exact = torch.zeros(2, 64)
    exact[0, :3] = torch.tensor([3.0, -0.75, 1.5])
    exact[1, 5] = -1024.0
    assert torch.equal(fp8_indexer.dequantize(*fp8_indexer.quantize(exact)), exact)


def test_pages_hold_each_blocks_values_then_its_scales():
    """The block layout byte by byte: block b's entry e has its D e4m3 bytes at e * D of the
    block and its float32 scale at E * D + 4 e; each block is E * (D + 4) bytes, so every
    key's values start 16-byte aligned (E a multiple of 4, D of 16)."""
    g = torch.Generator().manual_seed(4)
    keys = torch.randn(11, 64, generator=g)
    pages = fp8_indexer.pack(keys, 4)  # 3 blocks of 4 entries, the last one's last unwritten
    assert pages.shape == (3, 4, 68) and pages.dtype == torch.uint8
    values, scale = fp8_indexer.quantize(keys)
    raw = pages.view(3, 4 * 68)
    for slot in range(11):
        block, entry = divmod(slot, 4)
        assert torch.equal(raw[block, entry * 64 : entry * 64 + 64], values[slot].view(torch.uint8))
        at = 4 * 64 + 4 * entry
        assert torch.equal(raw[block, at : at + 4], scale[slot : slot + 1].view(torch.uint8))
    assert (raw[2, 3 * 64 : 4 * 64] == 0).all() and (raw[2, 4 * 64 + 12 :] == 0).all()
    back = fp8_indexer.read(pages, torch.tensor([10, 0, 5]))
    assert back.dtype == torch.float32
    assert torch.equal(back, fp8_indexer.dequantize(values, scale)[[10, 0, 5]])


def test_write_stores_the_quantized_keys_at_their_slots():
    """The cache's write entry point (the fused kernel's torch path on CPU) leaves every other
    slot's bytes as they were, in a page of FlashMLA's shape [blocks, E, 1, D + 4] too."""
    g = torch.Generator().manual_seed(1)
    keys = torch.randn(5, 64, generator=g)
    pages = torch.full((3, 4, 1, 68), 7, dtype=torch.uint8)
    slots = torch.tensor([9, 0, 4, 11, 2])
    triton_fp8_latent.write_indexer_key(pages, keys, slots)
    assert torch.equal(
        fp8_indexer.read(pages, slots), fp8_indexer.dequantize(*fp8_indexer.quantize(keys))
    )
    want = torch.full((3, 4, 1, 68), 7, dtype=torch.uint8)
    fp8_indexer.write_reference(want, keys, slots)
    assert torch.equal(pages, want)
    untouched = [s for s in range(12) if s not in slots.tolist()]
    values, scales = fp8_indexer.split(pages)
    block, entry = torch.tensor(untouched) // 4, torch.tensor(untouched) % 4
    assert (values[block, entry].view(torch.uint8) == 7).all()
    assert (scales[block, entry].view(torch.uint8) == 7).all()


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
    packed = fp8_indexer.pack(keys, 4)
    scale = dim**-0.5
    got = logits_rows_reference(q, packed, w, scale, plan)
    dequantized = fp8_indexer.dequantize(*fp8_indexer.quantize(keys))
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
