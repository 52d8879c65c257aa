"""The grouped MoE GEMM's device-side tile map (built with torch ops, no host sync): every
(token, expert) row sorted by expert is covered by exactly one M tile of its own expert."""

from __future__ import annotations

import pytest
import torch

from stages.kernels.triton_moe import TileMap


@pytest.mark.parametrize("counts,block_m", [
    ([5, 0, 17, 64, 1, 0, 0, 130], 16),
    ([0, 0, 0, 3], 64),
    ([64] * 8, 64),
    ([1] * 64, 64),
])
def test_tiles_cover_each_row_once(counts, block_m):
    c = torch.tensor(counts)
    tiles = TileMap.build(c, int(c.sum()), block_m)
    assert tiles.tile_expert.numel() >= sum(-(-n // block_m) for n in counts)
    seg_start = (c.cumsum(0) - c).tolist()
    seen = []
    for e, row in zip(tiles.tile_expert.tolist(), tiles.tile_row.tolist()):
        if e < 0:
            continue
        end = int(tiles.seg_end[e])
        assert seg_start[e] <= row < end  # a tile starts inside its expert's segment
        seen += range(row, min(row + block_m, end))
    assert sorted(seen) == list(range(int(c.sum())))
    # tiles past the real ones are marked empty, never a real expert
    real = sum(-(-n // block_m) for n in counts)
    assert (tiles.tile_expert[real:] == -1).all() and (tiles.tile_expert[:real] >= 0).all()
