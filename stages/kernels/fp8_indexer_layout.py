"""The FP8 indexer key's size (stages/kernels/fp8_indexer.py), without torch: the model configs
size caches with it in processes that never load torch."""

from __future__ import annotations

SCALE_BYTES = 4  # one float32 per key
GROUP = 128  # DeepSeek's 1 x 128 group: keys up to 128 values wide take one scale


def key_bytes(dim: int) -> int:
    """Bytes a cached key of `dim` values takes; refuses widths the layout cannot hold."""
    if dim > GROUP or dim % SCALE_BYTES:
        raise ValueError(
            f"the FP8 indexer key holds one scale over at most {GROUP} values (a multiple of "
            f"{SCALE_BYTES}), not index_head_dim {dim}"
        )
    return dim + SCALE_BYTES
