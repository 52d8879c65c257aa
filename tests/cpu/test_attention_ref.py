"""The torch reference attention against a naive einsum with an explicit bottom-right mask."""

import pytest
import torch

from stages.kernels import torch_ref
from stages.kernels.registry import select_kernels


def naive_attention(q, k, v, scale):
    t, hq, _ = q.shape
    length, hkv, _ = k.shape
    k = k.repeat_interleave(hq // hkv, dim=1)
    v = v.repeat_interleave(hq // hkv, dim=1)
    scores = torch.einsum("thd,lhd->htl", q.double(), k.double()) * scale
    # Query i is at position length - t + i and sees keys 0..length - t + i.
    qpos = torch.arange(t)[:, None] + (length - t)
    allowed = torch.arange(length)[None, :] <= qpos
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("htl,lhd->thd", scores.softmax(-1), v.double()).to(q.dtype)


@pytest.mark.parametrize("t,length", [(1, 1), (1, 9), (5, 5), (5, 13), (4, 4), (3, 17)])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (6, 1)])
def test_reference_matches_naive(t, length, hq, hkv):
    g = torch.Generator().manual_seed(t * 100 + length)
    q = torch.randn(t, hq, 16, generator=g)
    k = torch.randn(length, hkv, 16, generator=g)
    v = torch.randn(length, hkv, 16, generator=g)
    out = torch_ref.attention(q, k, v, 16 ** -0.5)
    assert out.shape == (t, hq, 16)
    torch.testing.assert_close(out, naive_attention(q, k, v, 16 ** -0.5), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("t,length", [(2, 2), (5, 13), (3, 40)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_mask_is_torchs_causal_bias_bit_for_bit(t, length, dtype):
    """Off CUDA the reference builds the bottom-right mask itself (torch.nn.attention.bias
    imports torch._dynamo, seconds of every stage process's start): the bits of SDPA under
    torch's causal_lower_right, which materializes that mask off CUDA."""
    from torch.nn.attention.bias import causal_lower_right

    g = torch.Generator().manual_seed(t + length)
    q = torch.randn(t, 4, 16, generator=g).to(dtype)
    k, v = (torch.randn(length, 2, 16, generator=g).to(dtype) for _ in range(2))
    q_, k_, v_ = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    want = torch.nn.functional.scaled_dot_product_attention(
        q_, k_, v_, attn_mask=causal_lower_right(t, length), scale=0.25, enable_gqa=True
    )[0].transpose(0, 1)
    assert torch.equal(torch_ref.attention(q, k, v, 0.25), want)


def test_chunk_differs_from_top_left_causal():
    # The bug this guards against: is_causal=True on a chunk after the first.
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(3, 2, 8, generator=g), torch.randn(7, 2, 8, generator=g), \
        torch.randn(7, 2, 8, generator=g)
    wrong = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True).transpose(0, 1)
    assert not torch.allclose(torch_ref.attention(q, k, v, 8 ** -0.5), wrong, atol=1e-3)


def test_registry_auto_and_explicit():
    kern = select_kernels("cpu")
    assert kern.names == {"linear": "torch", "attention": "torch", "decode_attention": "torch",
                          "paged_decode": "torch", "mla_decode": "torch",
                          "moe_experts": "torch", "moe_experts_mxfp4": "torch",
                          "mla_sparse": "torch", "index_topk": "torch",
                          "indexer_logits": "torch", "indexer_logits_rows": "torch",
                          "sparse_sink_attention": "torch", "sparse_sink_attention_fp8": "torch",
                          "hc_mix": "torch", "hc_merge": "torch", "rope_tail": "torch",
                          "rms_norm_fp32": "torch", "rope_angles": "torch",
                          "group_pool": "torch", "route_topk": "torch",
                          "v4_window_index": "torch", "v4_rate_index": "torch",
                          "v4_pick_slots": "torch",
                          "mla_sparse_fp8": "torch",
                          "mla_prefill_fp8": "torch"}
    with pytest.raises(ValueError, match="not available"):
        select_kernels("cpu", linear="triton-persistent")
    with pytest.raises(ValueError, match="unknown"):
        select_kernels("cpu", attention="nope")


@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (6, 1)])
def test_padded_decode_group_matches_each_row_alone(hq, hkv):
    """decode_attention over rows of different lengths, padded with garbage keys, equals the
    reference run on each row's own prefix."""
    g = torch.Generator().manual_seed(hq * 10 + hkv)
    lengths = [1, 7, 3, 12]
    width = max(lengths)
    q = torch.randn(len(lengths), hq, 16, generator=g)
    k = torch.randn(len(lengths), width, hkv, 16, generator=g) * 3  # padding is not zero
    v = torch.randn(len(lengths), width, hkv, 16, generator=g)
    mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    out = torch_ref.decode_attention(q, k, v, mask, 16 ** -0.5)
    for i, n in enumerate(lengths):
        alone = naive_attention(q[i:i + 1], k[i, :n], v[i, :n], 16 ** -0.5)[0]
        torch.testing.assert_close(out[i], alone, atol=1e-5, rtol=1e-5)


def test_partial_softmaxes_merge_exactly():
    """cudnn_attention.merge_partials (the cuDNN split's merge, which runs only on CUDA) rebuilds
    attention over all keys from its parts over a prefix and over the rest."""
    from stages.kernels.cudnn_attention import merge_partials

    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 5, 8, generator=g, dtype=torch.float64)  # [H, t, D]
    k = torch.randn(2, 11, 8, generator=g, dtype=torch.float64)
    v = torch.randn(2, 11, 8, generator=g, dtype=torch.float64)

    def part(keys, values):  # [H, t, D] output and [H, t] log-sum-exp over these keys
        scores = q @ keys.transpose(-1, -2)
        return scores.softmax(-1) @ values, scores.logsumexp(-1)

    merged = merge_partials(*part(k[:, :4], v[:, :4]), *part(k[:, 4:], v[:, 4:]))
    torch.testing.assert_close(merged.double(), part(k, v)[0], atol=1e-6, rtol=1e-6)


def _sdpa_with_lse(q, k, v, causal, scale):
    """What cudnn_attention._cudnn returns, computed on CPU: q/k/v [1, H, n, D] (GQA: fewer KV
    heads), top-left causal when asked -> (out [1, Hq, t, D], log-sum-exp [1, Hq, t] fp32)."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1).double(), v.repeat_interleave(g, dim=1).double()
    scores = (q.double() @ k.transpose(-1, -2)) * scale
    if causal:
        t, n = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(t, n, dtype=torch.bool).triu(1), float("-inf"))
    return (scores.softmax(-1) @ v).to(q.dtype), scores.logsumexp(-1).float()


@pytest.mark.parametrize("t,length", [(1, 9), (5, 5), (5, 13), (256, 256), (300, 300),
                                      (300, 700), (512, 1280), (600, 601), (512, 4608),
                                      (300, 4400), (700, 9000), (5, 8197)])
def test_cudnn_split_pads_cuts_and_merges_exactly(monkeypatch, t, length):
    """split_attention's own logic (the prefix cut at a multiple of KEY_ALIGN, the diagonal's
    top padding, query padding to Q_ALIGN, the merge) with the cuDNN call replaced by an exact
    CPU stand-in: equals the bottom-right causal reference, and cuDNN only ever sees query
    counts that are multiples of Q_ALIGN and prefix key counts that are multiples of
    KEY_ALIGN."""
    from stages.kernels import cudnn_attention as ca

    seen = []

    def fake_cudnn(q, k, v, causal, scale):
        seen.append((q.shape[2], k.shape[2], causal))
        return _sdpa_with_lse(q, k, v, causal, scale)

    monkeypatch.setattr(ca, "_cudnn", fake_cudnn)
    g = torch.Generator().manual_seed(t + length)
    q = torch.randn(t, 4, 16, generator=g, dtype=torch.float64)
    k = torch.randn(length, 2, 16, generator=g, dtype=torch.float64)
    v = torch.randn(length, 2, 16, generator=g, dtype=torch.float64)
    out = ca.split_attention(q, k, v, 0.25)
    # the merge runs in fp32
    torch.testing.assert_close(out, naive_attention(q, k, v, 0.25), atol=1e-5, rtol=1e-5)
    if t > 1:
        assert all(rows % ca.Q_ALIGN == 0 for rows, _, _ in seen), seen
        assert all(keys % ca.KEY_ALIGN == 0 for _, keys, causal in seen if not causal), seen
        has_prefix = length - t >= ca.KEY_ALIGN
        assert [c for _, _, c in seen] == ([True, False] if has_prefix else [True])


def test_paged_decode_reference_reads_scattered_blocks():
    """The paged decode oracle (what the Triton kernel is tested against on GPU) equals the
    padded-group reference on each row's keys, read through a scattered block table; a row of
    length 0 gives zeros."""
    from stages.kernels.torch_ref import decode_attention, paged_decode_attention

    g = torch.Generator().manual_seed(7)
    block, hq, hkv, d = 4, 6, 2, 8
    lengths = [1, 9, 0, 16]
    k = torch.randn(40 * block, hkv, d, generator=g)
    v = torch.randn(40 * block, hkv, d, generator=g)
    q = torch.randn(len(lengths), hq, d, generator=g)
    tables = torch.randperm(40, generator=g)[:20].view(5, 4).to(torch.int32)
    table_rows = torch.tensor([3, 0, 1, 4])
    out = paged_decode_attention(q, k, v, tables, table_rows, torch.tensor(lengths), 0.3, block)
    for r, n in enumerate(lengths):
        if n == 0:
            assert torch.all(out[r] == 0)
            continue
        pos = torch.arange(n)
        slots = tables[table_rows[r]].long()[pos // block] * block + pos % block
        ref = decode_attention(q[r:r + 1], k[slots][None], v[slots][None],
                               torch.ones(1, n, dtype=torch.bool), 0.3)
        torch.testing.assert_close(out[r], ref[0])


def test_sparse_mla_reference(monkeypatch):
    """mla_sparse over every key of each row, in any order and padded with -1, equals the dense
    absorbed MLA decode reference; a query with no key gets 0; tiles of rows change nothing."""
    g = torch.Generator().manual_seed(5)
    blocks, b, d, dv, h = 6, 4, 24, 16, 3
    pages = torch.randn(blocks, b, 1, d, generator=g)
    table = torch.tensor([[4, 1, 5], [2, 0, 3]], dtype=torch.int32)
    seqlens = torch.tensor([11, 7], dtype=torch.int32)
    q = torch.randn(2, h, d, generator=g)
    want = torch_ref.mla_decode(q, pages, table, seqlens, dv, 0.3, {})
    indices = torch.full((3, 16), -1, dtype=torch.int32)  # row 2: no key
    for r in range(2):
        slots = [int(table[r, p // b]) * b + p % b for p in range(int(seqlens[r]))]
        perm = torch.randperm(16, generator=g)[:len(slots)]
        indices[r, perm] = torch.tensor(slots, dtype=torch.int32)
    q3 = torch.cat((q, torch.randn(1, h, d, generator=g)))
    out = torch_ref.mla_sparse(q3, pages.view(-1, 1, d), indices, dv, 0.3)
    assert out.shape == (3, h, dv) and out.dtype == q3.dtype
    torch.testing.assert_close(out[:2], want, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[2], torch.zeros(h, dv))
    monkeypatch.setattr(torch_ref, "TILE_ELEMENTS", 1)  # one row per tile
    assert torch.equal(torch_ref.mla_sparse(q3, pages.view(-1, 1, d), indices, dv, 0.3), out)


def test_indexer_logits_reference(monkeypatch):
    """Sum over heads of weight x relu(scale x q.k), in one tile or one query per tile."""
    g = torch.Generator().manual_seed(6)
    q, k = torch.randn(5, 4, 8, generator=g), torch.randn(9, 8, generator=g)
    w = torch.randn(5, 4, generator=g)
    out = torch_ref.indexer_logits(q, k, w, 0.5)
    naive = torch.einsum("th,thl->tl", w.double(),
                         torch.relu(torch.einsum("thd,ld->thl", q.double(), k.double()) * 0.5))
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, naive.float(), atol=1e-5, rtol=1e-5)
    monkeypatch.setattr(torch_ref, "TILE_ELEMENTS", 1)
    torch.testing.assert_close(torch_ref.indexer_logits(q, k, w, 0.5), out, atol=0, rtol=0)
