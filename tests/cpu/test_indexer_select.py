"""V3.2's batched indexer selection (one plan per forward, one scoring call and one top-k per
layer) against the per-row loop it replaced (torch_ref.indexer_logits on each row's gathered
keys, its chunk's future masked, torch.topk), on decode rows of different lengths, chunk rows
(whose first queries see fewer than top-k keys) and scores with many exact ties (ReLU zeros).
The Triton kernel is checked the same way under Triton's CPU interpreter where installed."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stages.forward_batch import ForwardBatch
from stages.kernels import torch_ref
from stages.kernels.indexer_select import (
    MAXIMA_GROUP,
    SelectPlan,
    group_maxima,
    logits_rows_reference,
    maxima_buffer,
    scores_with_maxima,
    topk_slots,
)
from stages.models.dsa import SparseRows
from tests.select_rows import decode_plan

HEADS, DIM, TOPK, SLOTS = 4, 16, 8, 400


def _rows(g):
    """(offset, tokens, start, slots) of: 3 decode rows, a chunk starting before TOPK keys,
    a chunk after a long prefix; slots are distinct random cache slots."""
    shapes = [(1, 20), (1, 9), (1, 57), (6, 4), (5, 30)]  # (tokens, start)
    perm = torch.randperm(SLOTS, generator=g)
    rows, off, used = [], 0, 0
    for n, start in shapes:
        rows.append((off, n, start, perm[used : used + start + n]))
        off, used = off + n, used + start + n
    return rows, off


def _loop(q, keys, weights, scale, rows):
    """The per-row loop of stages/models/dsa.py before the plan: slots [T, topk], values."""
    out = torch.full((q.shape[0], TOPK), -1, dtype=torch.int32)
    values = torch.full((q.shape[0], TOPK), float("-inf"))
    for off, n, start, slots in rows:
        span = slice(off, off + n)
        logits = torch_ref.indexer_logits(q[span], keys[slots], weights[span], scale)
        if n > 1:
            future = torch.ones(n, n, dtype=torch.bool).triu(1)
            logits[:, -n:].masked_fill_(future, float("-inf"))
        best, pos = logits.topk(TOPK, dim=-1)
        out[span] = slots[pos].masked_fill(best == float("-inf"), -1).int()
        values[span] = best
    return out, values


def _inputs(seed: int, ties: bool):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(16, HEADS, DIM, generator=g)
    keys = torch.randn(SLOTS, DIM, generator=g)
    if ties:  # half the keys score exactly 0 for every head of every query: relu(-x) = 0
        q = q.abs()
        keys[::2] = -keys[::2].abs()
    weights = torch.rand(16, HEADS, generator=g)
    return q, keys, weights, g


@pytest.mark.parametrize("ties", [False, True])
def test_batched_selection_matches_the_row_loop(ties):
    q, keys, weights, g = _inputs(7, ties)
    rows, t = _rows(g)
    plan = decode_plan(rows, "cpu")
    assert plan.token_index.tolist() == list(range(t))
    logits = logits_rows_reference(q[:t], keys, weights[:t], 0.25, plan)
    picked = topk_slots(logits, plan, TOPK)
    ref, ref_values = _loop(q, keys, weights, 0.25, rows)
    # the same scores are chosen (a tie may be broken differently: torch.topk's is undefined)
    slot_score = {}
    for off, n, _start, slots in rows:
        for i in range(n):
            for j, s in enumerate(slots.tolist()):
                slot_score[(off + i, s)] = logits[off + i, j].item()
    for tok in range(t):
        got = sorted((slot_score[(tok, s)] for s in picked[tok].tolist() if s >= 0), reverse=True)
        want = [v for v in ref_values[tok].tolist() if v != float("-inf")]
        assert got == want
        if not ties:
            assert sorted(picked[tok].tolist()) == sorted(ref[tok].tolist())


def test_interpreted_kernel_matches_reference(triton_interpreter):
    from stages.kernels import triton_indexer

    q, keys, weights, g = _inputs(3, ties=True)
    rows, t = _rows(g)
    plan = decode_plan(rows, "cpu")
    q, weights = q[:t], weights[:t]
    # fp16: the interpreter's bf16 dot is wrong (raw bits); the GPU tests cover bf16
    q16, k16 = q.half(), keys.half()
    heads = 16  # the kernel's MMA needs >= 16 rows per tile
    q16 = q16.repeat(1, heads // HEADS, 1)
    w = weights.repeat(1, heads // HEADS) / 4
    maxima, ref_maxima = (maxima_buffer(t, plan.key_slots.shape[1], "cpu") for _ in "ab")
    out = triton_indexer.indexer_logits_rows(q16, k16, w, 0.25, plan, maxima=maxima)
    ref = logits_rows_reference(q16.float(), k16.float(), w, 0.25, plan, ref_maxima)
    assert torch.equal(out == float("-inf"), ref == float("-inf"))
    seen = ref != float("-inf")
    torch.testing.assert_close(out[seen], ref[seen], rtol=1e-3, atol=1e-3)
    # each op's group maxima are its own scores' (58 columns: the last group is short)
    assert maxima.shape[1] * MAXIMA_GROUP > out.shape[1]
    assert torch.equal(maxima, group_maxima(out, torch.empty_like(maxima)))
    assert torch.equal(ref_maxima, group_maxima(ref, torch.empty_like(maxima)))
    assert torch.equal(ref_maxima == float("-inf"), maxima == float("-inf"))


def test_scores_come_with_their_maxima_unless_the_plan_is_decode_rows_only():
    """scores_with_maxima: a plan with a chunk gets the scores' group maxima for the top-k; a
    plan of decode rows only gets none (the top-k then finds them itself)."""
    q, keys, weights, g = _inputs(11, ties=True)
    rows, t = _rows(g)
    mixed = decode_plan(rows, "cpu")
    scores, maxima = scores_with_maxima(
        logits_rows_reference, q[:t], keys, weights[:t], 0.25, mixed
    )
    assert maxima is not None
    assert torch.equal(maxima, group_maxima(scores, torch.empty_like(maxima)))
    decode_only = decode_plan([r for r in rows if r[1] == 1], "cpu")
    assert decode_only.chunk_tiles.shape[0] == 0
    n = decode_only.token_index.shape[0]
    scores, maxima = scores_with_maxima(
        logits_rows_reference, q[:n], keys, weights[:n], 0.25, decode_only
    )
    assert maxima is None and scores.shape == (n, decode_only.key_slots.shape[1])


# -- the tie rule, as a property of every batch ----------------------------------------------
def _row_rule(q, keys, weights, scale, slots, start, n, k):
    """One row alone, by the rule's definition: its tokens' scores over its own keys (the
    chunk's future -inf), a stable descending sort's first k; slots, -1 past the visible."""
    logits = torch_ref.indexer_logits(q, keys[slots], weights, scale)
    visible = torch.arange(start + 1, start + n + 1)
    logits.masked_fill_(torch.arange(start + n)[None, :] >= visible[:, None], float("-inf"))
    pos = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :k]
    unseen = logits.gather(1, pos) == float("-inf")
    picked = slots[pos].masked_fill(unseen, -1).int()
    return torch.nn.functional.pad(picked, (0, k - picked.shape[1]), value=-1)


@st.composite
def _batches(draw):
    """Rows of a forward: (start, tokens, block table), block size 4, a flat cache of 64
    blocks. Decode rows (one token) and chunks at any position, rows shorter and longer than
    top-k, and prefix hits: a row may reuse another row's leading blocks."""
    k = draw(st.integers(1, 12))
    rows, free = [], list(range(64))
    for _ in range(draw(st.integers(1, 6))):
        n = draw(st.integers(1, 9))
        start = draw(st.integers(0, 30))
        blocks = -(-(start + n) // 4)
        shared = []
        if rows and draw(st.booleans()):  # a prefix hit: another row's full leading blocks
            other = draw(st.sampled_from(rows))[2]
            shared = other[: min(len(other), start // 4, blocks)]
        table = shared + [free.pop() for _ in range(blocks - len(shared))]
        rows.append((start, n, table))
    return k, rows, draw(st.integers(1, 3)), draw(st.integers(0, 2**16))


@settings(max_examples=150, deadline=None)
@given(_batches())
def test_batched_selection_is_each_rows_stable_sort_selection(batch):
    """The batched plan (every selecting row padded to the batch's widest, one top-k) selects
    for each token exactly the slots its row alone selects by the rule, in the same order.
    Scores on a grid of small integers with one to three index heads: exact arithmetic and
    many exact ties (zeros and equal sums)."""
    k, rows, heads, seed = batch
    g = torch.Generator().manual_seed(seed)
    t = sum(n for _, n, _ in rows)
    q = torch.randint(-1, 2, (t, heads, 4), generator=g).float()
    keys = torch.randint(-1, 2, (256, 4), generator=g).float()
    weights = torch.randint(1, 3, (t, heads), generator=g).float()
    fb = ForwardBatch.build([(s, n, tab, True) for s, n, tab in rows], 4)
    sparse = SparseRows.build(fb, 4, k, torch.device("cpu"))
    picked = sparse.dense.clone()
    if sparse.plan is not None:
        logits = logits_rows_reference(
            q[sparse.plan.token_index], keys, weights[sparse.plan.token_index], 1.0, sparse.plan
        )
        picked[sparse.plan.token_index] = topk_slots(logits, sparse.plan, k)
    off = 0
    for start, n, table in rows:
        pos = torch.arange(start + n)
        slots = torch.tensor(table)[pos // 4] * 4 + pos % 4
        span = slice(off, off + n)
        want = _row_rule(q[span], keys, weights[span], 1.0, slots, start, n, k)
        if start + n <= k:  # attends densely: every visible key, in position order
            assert torch.equal(picked[span].sort(dim=-1).values, want.sort(dim=-1).values)
        else:
            assert torch.equal(picked[span], want)
        off += n


def test_rule_is_a_stable_descending_sort_with_signed_zeros():
    from stages.kernels.indexer_select import top_k_positions

    scores = torch.tensor([[0.0, -0.0, 1.0, float("-inf"), 0.0, -0.0, 1.0, -2.0]])
    assert top_k_positions(scores, 5).tolist() == [[2, 6, 0, 1, 4]]
    assert top_k_positions(scores, 8).tolist() == [[2, 6, 0, 1, 4, 5, 7, 3]]


def test_one_token_prefill_chunk_is_scored_as_a_chunk():
    """The Triton scorer sums a decode row's heads in another order than a chunk's: a prefill
    chunk of one token takes a chunk tile, so its scores are those it gets inside a longer
    chunk of another batch; a decode row takes a decode tile."""
    slots = torch.arange(12)
    rows = [(0, 1, 9, slots[:10], False), (1, 1, 11, slots, True)]
    plan = SelectPlan.build(rows, torch.device("cpu"))
    assert plan.chunk_tiles.tolist() == [[0, 0, 1]]
    assert plan.decode_tiles.tolist() == [[1, 1]]


def test_interpreted_fp8_kernel_matches_reference(triton_interpreter):
    """FP8 keys: the kernel scores e4m3 queries (quantized per head, fp8_indexer's rule) against
    the e4m3 keys; the reference dequantizes both. Equal up to the order of the sums."""
    from stages.kernels import fp8_indexer, triton_indexer

    q, keys, weights, g = _inputs(5, ties=True)
    rows, t = _rows(g)
    plan = decode_plan(rows, "cpu")
    heads = 16  # the decode tiles' MMA rows are the heads
    q = q[:t].repeat(1, heads // HEADS, 1) * torch.rand(t, heads, 1, generator=g)
    w = weights[:t].repeat(1, heads // HEADS) - 0.5
    packed = fp8_indexer.pack(keys, 4)  # the block layout: 4 entries a block
    maxima = maxima_buffer(t, plan.key_slots.shape[1], "cpu")
    out = triton_indexer.indexer_logits_rows(q, packed, w, 0.25, plan, maxima=maxima)
    assert torch.equal(maxima, group_maxima(out, torch.empty_like(maxima)))
    ref = logits_rows_reference(q, packed, w, 0.25, plan)
    assert torch.equal(out == float("-inf"), ref == float("-inf"))
    seen = ref != float("-inf")
    torch.testing.assert_close(out[seen], ref[seen], rtol=1e-4, atol=1e-4)
    # the FP8 queries are what both score: unquantized queries give other scores
    dequantized = fp8_indexer.dequantize(*fp8_indexer.quantize(keys))
    unquantized = logits_rows_reference(q, dequantized, w, 0.25, plan)
    assert not torch.allclose(out[seen], unquantized[seen], rtol=1e-3, atol=1e-3)


def test_interpreted_query_quantizer_matches_the_torch_rule(triton_interpreter):
    """The FP8 scores' query quantizer (one kernel) gives fp8_indexer.quantize_queries's bytes
    and the head weights times the softmax scale and each head's scale, in the order the torch
    path multiplies them."""
    from stages.kernels import fp8_indexer, triton_indexer

    g = torch.Generator().manual_seed(7)
    q = torch.randn(9, 16, 64, generator=g) * torch.logspace(-4, 3, 16)[None, :, None]
    q[2, 5] = 0  # a zero head: the scale's floor
    w = torch.randn(9, 16, generator=g)
    values, weights = triton_indexer.quantize_queries(q.bfloat16(), w, 0.125)
    want_values, q_scale = fp8_indexer.quantize_queries(q.bfloat16())
    assert torch.equal(values.view(torch.uint8), want_values.view(torch.uint8))
    assert torch.equal(weights, w * 0.125 * q_scale)
