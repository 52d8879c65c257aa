"""DeepSeek-V4's FP8 KV layout, the one FlashMLA's SM90 sparse decode reads for head dim 512
("MODEL1" in FlashMLA's sources; tests/quant.py there): 584 bytes per entry, arranged per page
block of P entries, not per entry:

- bytes [0, 576 P): entry i at 576 i: its 448 no-rope values as float8_e4m3 (7 tiles of 64),
  then its 64 rope values in bf16 (128 bytes);
- bytes [576 P, 584 P): entry i at 576 P + 8 i: the 7 tiles' scales as e8m0 (powers of two,
  the byte is the float32 exponent field), then one unused byte.

Each block is padded to a multiple of 576 bytes (FlashMLA's own tests do so; its SM100 kernels
require it, and it keeps every block 16-byte aligned where P is odd). Standard library only: the
control plane sizes caches from it.
"""

from __future__ import annotations

NOPE, ROPE, TILE = 448, 64, 64
TILES = NOPE // TILE  # 7
VALUE_BYTES = NOPE + 2 * ROPE  # 576: fp8 no-rope values, then bf16 rope values
SCALE_BYTES = TILES + 1  # 8: e8m0 per tile, one unused byte
ENTRY_BYTES = VALUE_BYTES + SCALE_BYTES  # 584
BLOCK_ALIGN = 576
HEAD_DIM = NOPE + ROPE  # 512


def block_bytes(entries: int) -> int:
    """Bytes one page block of `entries` packed entries takes, padded."""
    return -(-entries * ENTRY_BYTES // BLOCK_ALIGN) * BLOCK_ALIGN


def packed_bytes(entry_bytes: int, entries: int) -> int:
    """block_bytes with the family-level signature (bytes per entry, entries per block)."""
    if entry_bytes != ENTRY_BYTES:
        raise ValueError(
            f"the V4 FP8 layout packs {ENTRY_BYTES} bytes per entry, not {entry_bytes}"
        )
    return block_bytes(entries)
