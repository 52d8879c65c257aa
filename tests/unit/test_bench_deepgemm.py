"""The DeepGEMM bench's layout glue (app/bench/deepgemm.py), on CPU: our routing layout
(stages/kernels/moe_routing.route) read as DeepGEMM's contiguous grouped_layout
(moe_routing.contiguous_layout), and rows put back at their (token, k) slots."""

import pytest
import torch

from app.bench.deepgemm import by_pair, gather
from app.bench.deepgemm_probe import probe_kernel
from stages.kernels import fp8_ref
from stages.kernels.moe_routing import contiguous_layout, route


def routed(tokens, experts, k, block_m, seed, skip_expert=None):
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(tokens, experts, generator=g).topk(k, dim=-1).indices
    if skip_expert is not None:  # an expert another rank holds: its picks are -1
        ids = torch.where(ids == skip_expert, -1, ids)
    r = route(ids, torch.rand(tokens, k, generator=g), experts, block_m)
    return ids, r, contiguous_layout(r.pair_of_row, r.tile_expert, block_m)


@pytest.mark.parametrize("skip_expert", [None, 3])
@pytest.mark.parametrize("tokens,experts,k,block_m", [(50, 8, 2, 16), (300, 16, 6, 128)])
def test_each_row_names_its_pairs_expert_and_padding_is_minus_one(
    tokens, experts, k, block_m, skip_expert
):
    ids, r, layout = routed(tokens, experts, k, block_m, seed=tokens, skip_expert=skip_expert)
    assert layout.dtype == torch.int32 and layout.shape == r.pair_of_row.shape
    real = r.pair_of_row >= 0
    assert torch.equal(layout[real].long(), ids.reshape(-1)[r.pair_of_row[real].long()])
    assert (layout[~real] == -1).all()
    # per expert, as many rows as picks (a skipped pick has none)
    for e in range(experts):
        assert int((layout == e).sum()) == int((ids == e).sum())


@pytest.mark.parametrize("tokens,experts,k,block_m", [(50, 8, 2, 16), (300, 16, 6, 128)])
def test_every_block_is_one_expert_led_by_a_real_row(tokens, experts, k, block_m):
    """DeepGEMM takes an M block's expert from its first row and skips blocks that start at -1:
    a block holds one expert's rows, padding only after them, and no real row sits in a block
    whose first row is padding."""
    _ids, _r, layout = routed(tokens, experts, k, block_m, seed=k)
    for block in layout.view(-1, block_m):
        real = block[block >= 0]
        if real.numel():
            assert block[0] >= 0 and (real == block[0]).all()
            assert (block[: real.numel()] == block[0]).all()  # padding only at the end


def test_by_pair_puts_each_row_at_its_pair_and_drops_padding():
    ids, r, _layout = routed(40, 8, 2, 16, seed=1)
    pairs = ids.numel()
    rows = torch.randn(r.pair_of_row.numel(), 5)
    out = by_pair(rows, r.pair_of_row, pairs)
    real = r.pair_of_row >= 0
    assert out.shape == (pairs, 5)
    assert torch.equal(out[r.pair_of_row[real].long()], rows[real])


def test_gather_moves_fp8_rows_with_their_scales():
    q, s = fp8_ref.quantize_act(torch.randn(6, 256))
    index = torch.tensor([5, 0, 0, 3])
    rows, scales = gather(q, s, index)
    assert rows.dtype == fp8_ref.FP8
    assert torch.equal(rows.view(torch.uint8), q.view(torch.uint8)[index])
    assert torch.equal(scales, s[index])


def test_probe_reports_a_kernel_that_cannot_run_without_dying():
    """The probe's child fails here (no deep_gemm, no GPU): the bench records why and goes on
    (on the H200 host the child segfaults; a negative return code names the signal)."""
    probe = probe_kernel(timeout_s=120)
    assert probe["ok"] is False and probe["returncode"] not in (0, None)
    assert "deep_gemm" in probe["tail"] or "CUDA" in probe["tail"] or "cuda" in probe["tail"]
