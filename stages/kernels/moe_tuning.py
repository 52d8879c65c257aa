"""Tile sizes of the grouped MoE GEMMs (stages.kernels.triton_moe), per model shape.

The table holds the fastest configuration of a sweep on an H200 (``app/bench/moe.py --tune``,
docs/bench/moe_tuning.json) for each (experts, top-k, hidden, expert width); lookup takes the
entry of the same shape, else the defaults. The routing's M tile is shared by both GEMMs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


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
    gate: TileConfig = field(default_factory=lambda: TileConfig(block_n=64, num_stages=4))
    down: TileConfig = field(default_factory=TileConfig)

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "MoeConfig":
        return cls(d["block_m"], TileConfig(**d["gate"]), TileConfig(**d["down"]))


DEFAULT = MoeConfig()
# Fewer rows per expert than this (short chunks, decode batches): smaller M tiles waste less.
SMALL_ROWS_PER_EXPERT = 64
DEFAULT_SMALL = MoeConfig(
    block_m=64,
    gate=TileConfig(block_n=64, num_stages=4, num_warps=4),
    down=TileConfig(block_n=128, num_stages=4, num_warps=4),
)

# (experts, top-k, hidden, expert width) -> config
_TUNED: dict[tuple[int, int, int, int], MoeConfig] = {}


def pick_moe_config(tokens: int, topk: int, experts: int, hidden: int, inter: int) -> MoeConfig:
    tuned = _TUNED.get((experts, topk, hidden, inter))
    if tokens * topk < SMALL_ROWS_PER_EXPERT * experts:
        return DEFAULT_SMALL
    return tuned if tuned is not None else DEFAULT
