"""The deepgemm indexer_logits_rows backend (stages/kernels/deepgemm_indexer.py) on an SM90 GPU
with deep_gemm built (.gpu-deepgemm/deepgemm_build.sh): DeepGEMM's fp8_mqa_logits over the
chunk rows of a paged FP8 indexer cache (shuffled slots), the Triton decode kernel over the
decode rows of the same plan, against the row-at-a-time reference and the Triton backend; a
chunk row's scores alone equal its scores batched with other rows, bit for bit."""

from __future__ import annotations

import pytest
import torch

from stages.kernels import deepgemm_indexer, fp8_indexer, triton_indexer
from stages.kernels.indexer_select import group_maxima, logits_rows_reference, maxima_buffer
from tests.select_rows import decode_plan

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not deepgemm_indexer.is_available("cuda"), reason="needs an SM90 GPU and deep_gemm"
    ),
]

SCALE = 128**-0.5
# (tokens, first position) a row; one token: a decode row. Chunk rows around the Triton chunk
# tile (64 tokens) and DeepGEMM's 256-key blocks, one from position 0, beside decode rows.
MIXED = [(300, 4000), (1, 2100), (77, 0), (64, 255), (1, 9000), (65, 257), (129, 1)]


def _inputs(group_rows, heads=64, entries=16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    total = sum(n + start for n, start in group_rows)
    perm = torch.randperm(total + 100, generator=g, device="cuda")
    rows, off, used = [], 0, 0
    for n, start in group_rows:
        rows.append((off, n, start, perm[used : used + start + n]))
        off, used = off + n, used + start + n
    keys = torch.randn(total + 100, 128, generator=g, device="cuda").bfloat16()
    q = torch.randn(off, heads, 128, generator=g, device="cuda").bfloat16()
    w = torch.randn(off, heads, generator=g, device="cuda")
    return q, fp8_indexer.pack(keys, entries), w, rows


@pytest.mark.parametrize("heads", [64, 32])
def test_mixed_plan_matches_the_reference_and_the_triton_backend(heads):
    q, pages, w, rows = _inputs(MIXED, heads)
    plan = decode_plan(rows, "cuda")
    maxima = maxima_buffer(q.shape[0], plan.key_slots.shape[1], q.device)
    got = deepgemm_indexer.indexer_logits_rows(q, pages, w, SCALE, plan, maxima=maxima)
    ref = logits_rows_reference(q.float(), pages, w, SCALE, plan)
    triton = triton_indexer.indexer_logits_rows(q, pages, w, SCALE, plan)
    unseen = ref == float("-inf")
    assert torch.equal(got == float("-inf"), unseen)
    assert torch.equal(maxima, group_maxima(got, torch.empty_like(maxima)))
    seen = ~unseen
    err = ((got[seen] - ref[seen]).norm() / ref[seen].norm()).item()
    assert err < 2e-3, err  # the Triton kernels' band (test_indexer_kernel.py)
    # the same FP8 products summed in another order (measured 3.3e-7 on an H100)
    close = (got[seen] - triton[seen]).abs().max() / triton[seen].abs().max()
    assert close < 1e-5, close.item()
    decode = torch.tensor([n == 1 for _, n, _, _ in rows for _ in range(n)], device="cuda")
    assert torch.equal(got[decode], triton[decode])  # decode rows: the Triton decode kernel


def test_a_chunk_row_alone_equals_it_batched():
    q, pages, w, rows = _inputs(MIXED, seed=1)
    batched = deepgemm_indexer.indexer_logits_rows(q, pages, w, SCALE, decode_plan(rows, "cuda"))
    for off, n, start, slots in rows:
        if n == 1:
            continue
        alone_plan = decode_plan([(0, n, start, slots)], "cuda")
        alone = deepgemm_indexer.indexer_logits_rows(
            q[off : off + n], pages, w[off : off + n], SCALE, alone_plan
        )
        assert torch.equal(alone, batched[off : off + n, : start + n])


def test_bf16_keys_go_to_triton_counted():
    from stages.kernels.fallbacks import FALLBACKS

    q, _pages, w, _rows = _inputs([(100, 300)])
    keys = torch.randn(400, 128, device="cuda").bfloat16()
    plan = decode_plan([(0, 100, 300, torch.arange(400, device="cuda"))], "cuda")
    key = ("indexer_logits_rows", "deepgemm", "dtype")
    before = FALLBACKS.counts().get(key, 0)
    got = deepgemm_indexer.indexer_logits_rows(q, keys, w, SCALE, plan)
    assert torch.equal(got, triton_indexer.indexer_logits_rows(q, keys, w, SCALE, plan))
    assert FALLBACKS.counts()[key] == before + 1
