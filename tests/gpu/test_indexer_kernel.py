"""The Triton lightning-indexer kernel against the torch reference, same bf16 inputs (the
reference computes in fp32), at DeepSeek-V3.2's index shapes and at ragged tile edges."""

from __future__ import annotations

import pytest
import torch

from stages.kernels import torch_ref, triton_indexer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not triton_indexer.is_available("cuda"), reason="needs CUDA + Triton"),
]


@pytest.mark.parametrize("t,heads,dim,length", [(1, 64, 128, 5), (37, 64, 128, 1000),
                                                 (256, 64, 128, 8192), (100, 4, 64, 300)])
def test_indexer_logits_match_reference(t, heads, dim, length):
    g = torch.Generator(device="cuda").manual_seed(t + length)
    q = torch.randn(t, heads, dim, generator=g, device="cuda").bfloat16()
    k = torch.randn(length, dim, generator=g, device="cuda").bfloat16()
    w = torch.randn(t, heads, generator=g, device="cuda")
    scale = dim ** -0.5
    out = triton_indexer.indexer_logits(q, k, w, scale)
    ref = torch_ref.indexer_logits(q.float(), k.float(), w, scale)
    assert out.shape == (t, length) and out.dtype == torch.float32
    err = ((out - ref).norm() / ref.norm()).item()
    assert err < 2e-3, err
    # the selection built on it agrees with the reference's where scores are not near-ties
    top = min(64, length)
    picked = out.topk(top, dim=-1).indices
    assert (ref.gather(1, picked).min(dim=-1).values
            >= ref.topk(top, dim=-1).values[:, -1] - 1e-2 * ref.abs().max()).all()


@pytest.mark.parametrize("group_rows", [
    [(1, 5000), (1, 3000), (1, 9000)],  # decode rows (one token each, tiles of one)
    [(300, 4000), (1, 2100), (77, 0)],  # chunks (one from position 0) beside a decode row
])
def test_indexer_logits_rows_match_reference(group_rows):
    """The batched kernel over a paged cache (shuffled slots) against the row-at-a-time
    reference, at V3.2's index heads: the same -inf pattern, scores within the bf16 band."""
    from stages.kernels.indexer_select import SelectPlan, logits_rows_reference

    g = torch.Generator(device="cuda").manual_seed(len(group_rows))
    total = sum(n + start for n, start in group_rows)
    perm = torch.randperm(total + 100, generator=g, device="cuda")
    rows, off, used = [], 0, 0
    for n, start in group_rows:
        rows.append((off, n, start, perm[used:used + start + n]))
        off, used = off + n, used + start + n
    plan = SelectPlan.build(rows, torch.device("cuda"))
    keys = torch.randn(total + 100, 128, generator=g, device="cuda").bfloat16()
    q = torch.randn(off, 64, 128, generator=g, device="cuda").bfloat16()
    w = torch.randn(off, 64, generator=g, device="cuda")
    out = triton_indexer.indexer_logits_rows(q, keys, w, 128 ** -0.5, plan)
    ref = logits_rows_reference(q.float(), keys.float(), w, 128 ** -0.5, plan)
    assert torch.equal(out == float("-inf"), ref == float("-inf"))
    seen = ref != float("-inf")
    err = ((out[seen] - ref[seen]).norm() / ref[seen].norm()).item()
    assert err < 2e-3, err


def test_batched_selection_equals_the_row_loop_with_ties():
    """On CUDA the batched selection picks exactly the per-row loop's slots (the loop of
    stages/models/dsa.py before the plan: indexer_logits per row, future masked, torch.topk),
    ties included: half the keys score exactly 0 for every query. Chunk rows' scores are the
    per-row kernel's bit for bit."""
    from stages.kernels.indexer_select import SelectPlan, topk_slots

    g = torch.Generator(device="cuda").manual_seed(11)
    shapes, topk = [(1, 3000), (1, 2500), (700, 1800), (300, 4000)], 2048
    total = sum(n + start for n, start in shapes)
    keys = torch.randn(total, 128, generator=g, device="cuda")
    keys[::2] = -keys[::2].abs()
    keys = keys.bfloat16()
    perm = torch.randperm(total, generator=g, device="cuda")
    rows, off, used = [], 0, 0
    for n, start in shapes:
        rows.append((off, n, start, perm[used:used + start + n]))
        off, used = off + n, used + start + n
    q = torch.randn(off, 64, 128, generator=g, device="cuda").abs().bfloat16()
    w = torch.rand(off, 64, generator=g, device="cuda")
    scale = 128 ** -0.5
    plan = SelectPlan.build(rows, torch.device("cuda"))
    logits = triton_indexer.indexer_logits_rows(q, keys, w, scale, plan)
    picked = topk_slots(logits, plan, topk)
    for off_r, n, start, slots in rows:
        span = slice(off_r, off_r + n)
        ref = triton_indexer.indexer_logits(q[span], keys[slots], w[span], scale)
        if n > 1:
            assert torch.equal(logits[span, :start + n].masked_fill(
                logits[span, :start + n] == float("-inf"), 0),
                ref.masked_fill(logits[span, :start + n] == float("-inf"), 0))
            ref[:, -n:].masked_fill_(torch.ones(n, n, dtype=torch.bool, device="cuda").triu(1),
                                     float("-inf"))
        best, pos = ref.topk(topk, dim=-1)
        want = slots[pos].masked_fill(best == float("-inf"), -1)
        assert torch.equal(picked[span].sort(dim=-1).values, want.int().sort(dim=-1).values)
