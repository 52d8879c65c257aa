"""The Triton lightning-indexer kernel against the torch reference, same bf16 inputs (the
reference computes in fp32), at DeepSeek-V3.2's index shapes and at ragged tile edges; the same
with FP8 keys (an FP8 cache's: e4m3 values and a float32 scale per token), whose
quantize-on-write kernel writes the torch quantizer's bytes."""

from __future__ import annotations

import pytest
import torch

from stages.kernels import fp8_indexer, torch_ref, triton_fp8_latent, triton_indexer
from tests.select_rows import decode_plan

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not triton_indexer.is_available("cuda"), reason="needs CUDA + Triton"),
]


@pytest.mark.parametrize(
    "t,heads,dim,length",
    [(1, 64, 128, 5), (37, 64, 128, 1000), (256, 64, 128, 8192), (100, 4, 64, 300)],
)
def test_indexer_logits_match_reference(t, heads, dim, length):
    g = torch.Generator(device="cuda").manual_seed(t + length)
    q = torch.randn(t, heads, dim, generator=g, device="cuda").bfloat16()
    k = torch.randn(length, dim, generator=g, device="cuda").bfloat16()
    w = torch.randn(t, heads, generator=g, device="cuda")
    scale = dim**-0.5
    out = triton_indexer.indexer_logits(q, k, w, scale)
    ref = torch_ref.indexer_logits(q.float(), k.float(), w, scale)
    assert out.shape == (t, length) and out.dtype == torch.float32
    err = ((out - ref).norm() / ref.norm()).item()
    assert err < 2e-3, err
    # the selection built on it agrees with the reference's where scores are not near-ties
    top = min(64, length)
    picked = out.topk(top, dim=-1).indices
    assert (
        ref.gather(1, picked).min(dim=-1).values
        >= ref.topk(top, dim=-1).values[:, -1] - 1e-2 * ref.abs().max()
    ).all()


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-keys", "fp8-keys"])
@pytest.mark.parametrize(
    "group_rows",
    [
        [(1, 5000), (1, 3000), (1, 9000)],  # decode rows (one token each, tiles of one)
        [(300, 4000), (1, 2100), (77, 0)],  # chunks (one from position 0) beside a decode row
    ],
)
def test_indexer_logits_rows_match_reference(group_rows, fp8):
    """The batched kernel over a paged cache (shuffled slots) against the row-at-a-time
    reference, at V3.2's index heads: the same -inf pattern, scores within the bf16 band. FP8
    keys: the reference dequantizes the same bytes (fp32 math)."""
    from stages.kernels.indexer_select import group_maxima, logits_rows_reference, maxima_buffer

    g = torch.Generator(device="cuda").manual_seed(len(group_rows))
    total = sum(n + start for n, start in group_rows)
    perm = torch.randperm(total + 100, generator=g, device="cuda")
    rows, off, used = [], 0, 0
    for n, start in group_rows:
        rows.append((off, n, start, perm[used : used + start + n]))
        off, used = off + n, used + start + n
    plan = decode_plan(rows, "cuda")
    keys = torch.randn(total + 100, 128, generator=g, device="cuda").bfloat16()
    q = torch.randn(off, 64, 128, generator=g, device="cuda").bfloat16()
    w = torch.randn(off, 64, generator=g, device="cuda")
    if fp8:  # V3.2's 64-token blocks: a page of 64 keys
        keys = fp8_indexer.pack(keys, 64)
        assert keys.shape == (-(-(total + 100) // 64), 64, 132) and keys.dtype == torch.uint8
    out = triton_indexer.indexer_logits_rows(q, keys, w, 128**-0.5, plan)
    ref = logits_rows_reference(q.float(), keys if fp8 else keys.float(), w, 128**-0.5, plan)
    assert torch.equal(out == float("-inf"), ref == float("-inf"))
    # the group maxima written beside the scores: the same scores, and their groups' maxima
    maxima = maxima_buffer(off, out.shape[1], out.device)
    assert torch.equal(triton_indexer.indexer_logits_rows(q, keys, w, 128**-0.5, plan,
                                                          maxima=maxima), out)  # fmt: skip
    assert torch.equal(maxima, group_maxima(out, torch.empty_like(maxima)))
    seen = ref != float("-inf")
    err = ((out[seen] - ref[seen]).norm() / ref[seen].norm()).item()
    assert err < 2e-3, err


@pytest.mark.parametrize("dim", [128, 64])
def test_fp8_key_write_matches_the_torch_quantizer(dim):
    """The quantize-on-write kernel stores fp8_indexer.write_reference's bytes at the given
    slots of the block pages (16 entries a block, V4's; [blocks, E, 1, D + 4], V3.2's) and
    leaves every other byte alone."""
    g = torch.Generator(device="cuda").manual_seed(dim)
    keys = (
        torch.randn(300, dim, generator=g, device="cuda")
        * torch.logspace(-3, 2, 300, device="cuda")[:, None]
    ).bfloat16()
    keys[7] = 0  # an all-zero key: the scale's floor
    slots = torch.randperm(1024, generator=g, device="cuda")[:300]
    for shape in ((64, 16, dim + 4), (16, 64, 1, dim + 4)):
        fused = torch.randint(0, 255, shape, generator=g, device="cuda", dtype=torch.uint8)
        ref = fused.clone()
        triton_fp8_latent.write_indexer_key(fused, keys, slots)
        fp8_indexer.write_reference(ref, keys, slots)
        assert torch.equal(fused, ref)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-keys", "fp8-keys"])
def test_batched_selection_equals_the_row_loop_with_ties(fp8):
    """On CUDA the batched selection picks exactly the per-row loop's slots (the loop of
    stages/models/dsa.py before the plan: indexer_logits per row, future masked, then the tie
    rule as a stable sort defines it), ties included: half the keys score exactly 0 for every
    query. Chunk rows' scores are the per-row kernel's bit for bit. FP8 keys: the batched
    kernel scores FP8 queries against the e4m3 bytes on FP8 tensor cores, the loop the same
    queries and keys dequantized to bf16 (exact) on bf16 ones: scores equal up to the
    accumulators' rounding; the selection is then checked against the rule over the batched
    scores themselves (a rounding apart, near-ties could go either way). Both top-k backends
    pick the same."""
    from stages.kernels import triton_topk
    from stages.kernels.indexer_select import topk_slots

    g = torch.Generator(device="cuda").manual_seed(11)
    shapes, topk = [(1, 3000), (1, 2500), (700, 1800), (300, 4000)], 2048
    total = sum(n + start for n, start in shapes)
    keys = torch.randn(total, 128, generator=g, device="cuda")
    keys[::2] = -keys[::2].abs()
    keys = keys.bfloat16()
    packed = fp8_indexer.pack(keys, 64) if fp8 else keys
    if fp8:
        keys = fp8_indexer.dequantize(*fp8_indexer.quantize(keys)).bfloat16()
    perm = torch.randperm(total, generator=g, device="cuda")
    rows, off, used = [], 0, 0
    for n, start in shapes:
        rows.append((off, n, start, perm[used : used + start + n]))
        off, used = off + n, used + start + n
    q = torch.randn(off, 64, 128, generator=g, device="cuda").abs().bfloat16()
    w = torch.rand(off, 64, generator=g, device="cuda")
    scale = 128**-0.5
    plan = decode_plan(rows, "cuda")
    logits = triton_indexer.indexer_logits_rows(q, packed, w, scale, plan)
    picked = topk_slots(logits, plan, topk)
    assert torch.equal(picked, topk_slots(logits, plan, topk, triton_topk.top_k_positions))
    if fp8:  # what the FP8 kernel scores: the queries rounded through e4m3
        q8, q_scale = fp8_indexer.quantize_queries(q)
        q = (q8.float() * q_scale[..., None]).bfloat16()
    for off_r, n, start, slots in rows:
        span = slice(off_r, off_r + n)
        ref = triton_indexer.indexer_logits(q[span], keys[slots], w[span], scale)
        if n > 1:
            unseen = logits[span, : start + n] == float("-inf")
            got = logits[span, : start + n].masked_fill(unseen, 0)
            if fp8:
                # the FP8 MMA's accumulation differs: a dot near 0 may take the other side
                torch.testing.assert_close(got, ref.masked_fill(unseen, 0), rtol=1e-3, atol=1e-3)
                ref = logits[span, : start + n].clone()
            else:
                assert torch.equal(got, ref.masked_fill(unseen, 0))
            ref[:, -n:].masked_fill_(
                torch.ones(n, n, dtype=torch.bool, device="cuda").triu(1), float("-inf")
            )
        elif fp8:
            ref = logits[span, : start + n].clone()
        pos = torch.sort(ref, dim=-1, descending=True, stable=True).indices[:, :topk]
        want = slots[pos].masked_fill(ref.gather(1, pos) == float("-inf"), -1)
        assert torch.equal(picked[span].sort(dim=-1).values, want.int().sort(dim=-1).values)


@pytest.mark.parametrize(
    "tokens,width,k",
    # the candidates' top-k on the rule kernel over their live prefixes; over whole lines
    # (CANDIDATE_PREFIX off) at 1100 lines the kernel's, at 2100 (past
    # triton_topk.RULE_KERNEL_MAX_LINES) torch's
    [(64, 300, 16), (512, 65536, 2048), (8, 400000, 512), (300, 70000, 512), (1100, 8192, 256),
     (2100, 8192, 256)],
)
def test_tie_rule_on_cuda_is_a_stable_sort(tokens, width, k, monkeypatch):
    """top_k_positions on CUDA (one-block and multi-block top-k alike) keeps a stable
    descending sort's first k, in its order, on lines full of exact ties and of -0.0 beside
    0.0; torch's float top-k is checked beside it for the record only. The radix kernel
    (triton_topk) picks the same."""
    from stages.kernels import triton_topk
    from stages.kernels.indexer_select import top_k_positions

    g = torch.Generator(device="cuda").manual_seed(3)
    scores = torch.randn(tokens, width, generator=g, device="cuda").relu().round()
    scores[:, ::3] = -scores[:, ::3]  # -0.0 where the value was 0
    scores[:, -5:] = float("-inf")
    want = torch.sort(scores + 0.0, dim=-1, descending=True, stable=True).indices[:, :k]
    assert torch.equal(triton_topk.top_k_positions(scores.clone(), k), want)
    # theta found in the compaction kernel: the maxima in registers (65536 / 8 groups), or
    # walked (400000 / 8)
    assert torch.equal(triton_topk.top_k_positions(scores.clone(), k, find_theta=True), want)
    # the compaction's scores read step by step of the maxima (the default reads them over the
    # taken groups' indices, triton_topk.GATHER)
    assert torch.equal(triton_topk.top_k_positions(scores.clone(), k, gather=None), want)
    monkeypatch.setattr(triton_topk, "CANDIDATE_PREFIX", False)
    assert torch.equal(triton_topk.top_k_positions(scores.clone(), k), want)
    assert torch.equal(top_k_positions(scores, k), want)


def test_query_quantizer_matches_the_torch_rule():
    """The FP8 scores' query quantizer gives fp8_indexer.quantize_queries's bytes and the head
    weights times the softmax scale and each head's scale, at V4's index heads."""
    g = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(333, 64, 128, generator=g, device="cuda")
    q = (q * torch.logspace(-4, 3, 64, device="cuda")[None, :, None]).bfloat16()
    q[7, 3] = 0  # a zero head: the scale's floor
    w = torch.randn(333, 64, generator=g, device="cuda").bfloat16()
    values, weights = triton_indexer.quantize_queries(q, w, 128**-0.5)
    want, q_scale = fp8_indexer.quantize_queries(q)
    assert torch.equal(values.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(weights, w.float() * 128**-0.5 * q_scale)
