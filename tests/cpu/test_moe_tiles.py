"""The grouped MoE GEMM's device-side layout (built with torch ops, no host sync): every
(token, expert) pair lands in exactly one padded row of an M tile of its own expert, with its
routing weight; and the Triton kernels, run by Triton's CPU interpreter where triton is
installed, match the torch reference."""

from __future__ import annotations

import pytest
import torch

from stages.kernels import torch_ref
from stages.kernels.moe_routing import route


@pytest.mark.parametrize(
    "counts,block_m",
    [
        ([5, 0, 17, 64, 1, 0, 0, 130], 16),
        ([0, 0, 0, 3], 64),
        ([64] * 8, 64),
        ([1] * 64, 64),
    ],
)
def test_route_places_each_pair_once_in_its_experts_tiles(counts, block_m):
    k = 2
    ids = torch.cat([torch.full((n,), e) for e, n in enumerate(counts)])
    ids = ids[torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(0))]
    ids = ids.view(-1, k) if ids.numel() % k == 0 else ids.view(-1, 1)
    weights = torch.rand(ids.shape, generator=torch.Generator().manual_seed(1))
    r = route(ids, weights, len(counts), block_m)
    real = sum(-(-n // block_m) for n in counts)
    assert int(r.num_tiles) == real <= r.max_tiles
    pair = r.pair_of_row.view(-1, block_m)
    flat = ids.reshape(-1)
    placed = []
    for m in range(r.max_tiles):
        mine = pair[m][pair[m] >= 0]
        if m >= real:  # tiles past the real ones hold no pair
            assert mine.numel() == 0
            continue
        assert mine.numel() > 0 and (flat[mine.long()] == int(r.tile_expert[m])).all()
        placed += mine.tolist()
    assert sorted(placed) == list(range(flat.numel()))
    used = r.pair_of_row >= 0
    torch.testing.assert_close(r.row_weight[used], weights.reshape(-1)[r.pair_of_row[used].long()])
    assert (r.row_weight[~used] == 0).all()


@pytest.mark.parametrize(
    "tokens,hidden,inter,experts,k,limit",
    [(37, 64, 48, 5, 2, None), (20, 40, 24, 3, 3, None), (37, 64, 48, 5, 2, 0.05)],
)
def test_interpreted_kernels_match_reference(
    triton_interpreter, tokens, hidden, inter, experts, k, limit
):
    from stages.kernels import triton_moe
    from stages.kernels.moe_tuning import MoeConfig, TileConfig

    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=g).half()
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g) * hidden**-0.5).half()
    down = (torch.randn(experts, hidden, inter, generator=g) * inter**-0.5).half()
    weights, ids = torch.randn(tokens, experts, generator=g).softmax(-1).topk(k, dim=-1)
    # fp16: the interpreter's bf16 dot is wrong (raw bits); the GPU tests cover bf16
    tile = TileConfig(block_n=16, block_k=16, group_m=2, num_stages=1, num_warps=1)
    out = triton_moe.run_moe(x, gate_up, down, ids, weights, 3, MoeConfig(16, tile, tile), limit)
    ref = torch_ref.moe_experts(x.float(), gate_up.float(), down.float(), ids, weights, limit)
    if limit is not None:  # the clamp bites: the test would pass without it otherwise
        unclamped = torch_ref.moe_experts(x.float(), gate_up.float(), down.float(), ids, weights)
        assert ((unclamped - ref).norm() / ref.norm()).item() > 0.1
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2


def test_skipped_picks_get_no_row():
    """Expert parallelism: picks of id -1 (experts another rank holds) are left out of the
    layout, and the reference experts add nothing for them."""
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 5, (30, 2), generator=g)
    weights = torch.rand(30, 2, generator=g)
    skip = torch.rand(30, 2, generator=g) < 0.4
    r = route(ids.masked_fill(skip, -1), weights, 5, 16)
    kept = r.pair_of_row[r.pair_of_row >= 0].long()
    assert sorted(kept.tolist()) == (~skip).reshape(-1).nonzero().flatten().tolist()
    assert (
        int(r.num_tiles)
        == route(ids[~skip].view(-1, 1), weights[~skip].view(-1, 1), 5, 16).num_tiles
    )
    x = torch.randn(30, 8, generator=g)
    gate_up, down = torch.randn(5, 12, 8, generator=g), torch.randn(5, 8, 6, generator=g)
    got = torch_ref.moe_experts(x, gate_up, down, ids.masked_fill(skip, -1), weights)
    want = torch_ref.moe_experts(x, gate_up, down, ids, weights.masked_fill(skip, 0.0))
    torch.testing.assert_close(got, want)


def test_interpreted_kernels_skip_picks(triton_interpreter):
    """The Triton routing and grouped GEMMs with -1 picks: the reference without them."""
    from stages.kernels import triton_moe
    from stages.kernels.moe_tuning import MoeConfig, TileConfig

    g = torch.Generator().manual_seed(9)
    tokens, hidden, inter, experts = 21, 32, 16, 4
    x = torch.randn(tokens, hidden, generator=g).half()
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g) * hidden**-0.5).half()
    down = (torch.randn(experts, hidden, inter, generator=g) * inter**-0.5).half()
    weights, ids = torch.randn(tokens, 6, generator=g).softmax(-1).topk(2, dim=-1)
    ids = ids.masked_fill(ids >= experts, -1)  # picks of experts 4 and 5: another rank's
    assert (ids < 0).any() and (ids >= 0).any()
    tile = TileConfig(block_n=16, block_k=16, group_m=2, num_stages=1, num_warps=1)
    out = triton_moe.run_moe(x, gate_up, down, ids, weights, 3, MoeConfig(16, tile, tile))
    ref = torch_ref.moe_experts(x.float(), gate_up.float(), down.float(), ids, weights)
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.parametrize("one_program", [True, False], ids=["count-plan", "count-then-plan"])
def test_interpreted_routing_matches_reference_layout(triton_interpreter, one_program, monkeypatch):
    """The Triton layout: the same tiles and experts as route's, each tile holding the same
    pairs (in any order) with their weights, each pair's token row copied in; planned by one
    program (a decode batch's) or by the atomic count then the plan (a prefill chunk's), a pick
    of id -1 left out either way."""
    from stages.kernels import moe_routing
    from stages.kernels.moe_routing import route_and_gather

    monkeypatch.setattr(moe_routing, "ONE_PROGRAM_PAIRS", 4096 if one_program else 0)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 6, (50, 3), generator=g)
    ids[:20] = 2  # one busy expert; others sparse
    ids[30, 1] = -1
    weights = torch.rand(50, 3, generator=g)
    x = torch.randn(50, 24, generator=g).half()
    ref = route(ids, weights, 7, 16)
    r, a = route_and_gather(x, ids, weights, 7, 16)
    assert int(r.num_tiles) == int(ref.num_tiles) and int((r.pair_of_row >= 0).sum()) == 149
    torch.testing.assert_close(r.tile_expert, ref.tile_expert, atol=0, rtol=0)
    for m in range(int(ref.num_tiles)):
        span = slice(m * 16, (m + 1) * 16)
        mine, theirs = r.pair_of_row[span], ref.pair_of_row[span]
        assert sorted(mine.tolist()) == sorted(theirs.tolist())
        assert 30 * 3 + 1 not in mine.tolist()
        used = mine >= 0
        pair = mine[used].long()
        torch.testing.assert_close(r.row_weight[span][used], weights.reshape(-1)[pair])
        torch.testing.assert_close(a[span][used], x[pair // 3], atol=0, rtol=0)
        rows = torch.arange(m * 16, (m + 1) * 16)[used]
        assert torch.equal(r.row_of_pair.long()[pair], rows)  # the inverse of pair_of_row
    real = ref.pair_of_row >= 0
    assert torch.equal(ref.row_of_pair.long()[ref.pair_of_row[real].long()], real.nonzero()[:, 0])
    assert int(ref.row_of_pair[30 * 3 + 1]) == -1


def test_interpreted_scaled_routing_copies_each_rows_scales(triton_interpreter):
    """route_and_gather_scaled (the FP8 MoE's): each pair's quantized row (as bytes) and its
    1 x 128 scales land in the same row of the layout; a pick of id -1 gets neither."""
    from stages.kernels.moe_routing import contiguous_layout, route_and_gather_scaled

    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 5, (40, 2), generator=g)
    ids[3, 1] = -1
    weights = torch.rand(40, 2, generator=g)
    rows = torch.randint(0, 256, (40, 384), generator=g, dtype=torch.uint8)
    scales = torch.rand(40, 3, generator=g)
    for deepgemm in (False, True):  # DeepGEMM's: scales [S, rows] (MN-major), each row's expert
        r, a, a_scale = route_and_gather_scaled(rows, scales, ids, weights, 5, 16, deepgemm)
        used = r.pair_of_row >= 0
        pair = r.pair_of_row[used].long()
        assert sorted(pair.tolist()) == [p for p in range(80) if p != 7]
        assert torch.equal(a[used], rows[pair // 2])
        assert torch.equal(a_scale[used], scales[pair // 2])
        assert a_scale.stride() == ((1, a.shape[0]) if deepgemm else (3, 1))
        # each pair's row, the inverse of pair_of_row
        row = used.nonzero().flatten()
        assert torch.equal(r.row_of_pair.long()[pair], row)
        if deepgemm:  # m_indices: the torch form's, -1 on padding and past the tiles in use
            want = contiguous_layout(r.pair_of_row, r.tile_expert, 16)
            assert r.expert_of_row is not None and torch.equal(r.expert_of_row, want)
        else:
            assert r.expert_of_row is None
