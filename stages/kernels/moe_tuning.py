"""Tile sizes of the grouped MoE GEMMs (stages.kernels.triton_moe), per model shape.

The table holds the fastest configuration of a sweep on an H200 (``python -m app.bench.moe
--tune``, docs/bench/moe_kernels.json) for each (experts, top-k, hidden, expert width); lookup
takes the entry of the same shape, else the defaults. The routing's M tile is shared by both GEMMs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class TileConfig:
    block_n: int = 128
    block_k: int = 64
    group_m: int = 8
    num_stages: int = 3
    num_warps: int = 8
    flatten: bool = False  # one software pipeline across tiles (prefetch the next tile's K)
    warp_specialize: bool = False


@dataclass(frozen=True)
class MoeConfig:
    block_m: int = 128
    gate: TileConfig = field(default_factory=TileConfig)  # block_n: each of gate and up
    down: TileConfig = field(default_factory=lambda: TileConfig(block_n=256))

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "MoeConfig":
        return cls(d["block_m"], TileConfig(**d["gate"]), TileConfig(**d["down"]))


DEFAULT = MoeConfig()
# Fewer rows per expert than this (short chunks, decode batches): smaller M tiles waste less.
SMALL_ROWS_PER_EXPERT = 64
DEFAULT_SMALL = MoeConfig(
    block_m=64,
    gate=TileConfig(block_n=64, num_stages=4, num_warps=4),
    down=TileConfig(block_n=128, num_stages=4, num_warps=4),
)

# (experts, top-k, hidden, expert width) -> config. The sweep's winner was the same for every
# shape at 4K and 8K tokens (M 128; gate/up N 128 per half, K 64, 3 stages, 8 warps; down N 256)
# except V4 at 4K (down N 128, K 128: within 2 % of this one); listed so a new winner of a
# shape has its place.
_SWEPT = MoeConfig(128, TileConfig(128, 64, 8, 3, 8), TileConfig(256, 64, 8, 3, 8))
_TUNED: dict[tuple[int, int, int, int], MoeConfig] = {
    (64, 6, 2048, 1408): _SWEPT,  # DeepSeek-V2-Lite
    (256, 8, 7168, 2048): _SWEPT,  # DeepSeek-V3
    (128, 8, 2048, 768): _SWEPT,  # Qwen3-MoE (30B-A3B)
    (256, 6, 4096, 2048): _SWEPT,  # DeepSeek-V4
}


def pick_moe_config(tokens: int, topk: int, experts: int, hidden: int, inter: int) -> MoeConfig:
    tuned = _TUNED.get((experts, topk, hidden, inter))
    if tokens * topk < SMALL_ROWS_PER_EXPERT * experts:
        return DEFAULT_SMALL
    return tuned if tuned is not None else DEFAULT
