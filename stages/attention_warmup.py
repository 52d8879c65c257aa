"""Startup warm-up of the prefill chunks' dense attention on cuDNN: one call on each
(queries, keys) shape a long lone prompt's chunks meet and on every diagonal square a chunk can
need, over zero Q/K/V of the family's widths, so cuDNN's per-shape graphs (~50 ms each on H200)
are built before a request needs them (docs/PERFORMANCE.md, "First requests")."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from stages.kernels.cudnn_attention import diagonal_sizes


@torch.inference_mode()
def build_chunk_attention_graphs(
    attention: Callable[..., Any],
    dims: tuple[int, int, int, int],
    chunks: list[tuple[int, int]],
    dtype: torch.dtype,
    device: torch.device,
) -> dict[str, float]:
    """dims: (query heads, K/V heads, q/k width, v width); chunks: (prefix, tokens) pairs. Shapes
    with more keys than a quarter of the free memory holds are left to the first request."""
    if not chunks:
        return {"shapes": 0, "seconds": 0.0}
    t0 = time.perf_counter()
    heads, kv_heads, qk_dim, v_dim = dims
    longest = max(n for _, n in chunks)
    shapes = {(n, p + n) for p, n in chunks}
    shapes |= {(s, s) for s in diagonal_sizes(longest)}  # a square: the diagonal alone
    free, _total = torch.cuda.mem_get_info(device)
    per_key = kv_heads * (qk_dim + v_dim) * dtype.itemsize
    max_keys = min(max(length for _, length in shapes), free // 4 // per_key)
    to_build = sorted((n, length) for n, length in shapes if length <= max_keys)
    if not to_build:
        return {"shapes": 0, "skipped": len(shapes), "seconds": 0.0}
    q = torch.zeros(max(n for n, _ in to_build), heads, qk_dim, dtype=dtype, device=device)
    k = torch.zeros(max_keys, kv_heads, qk_dim, dtype=dtype, device=device)
    v = torch.zeros(max_keys, kv_heads, v_dim, dtype=dtype, device=device)
    for n, length in to_build:
        attention(q[:n], k[:length], v[:length], qk_dim**-0.5)
    torch.cuda.synchronize(device)
    del q, k, v
    torch.cuda.empty_cache()
    return {
        "shapes": len(to_build),
        "skipped": len(shapes) - len(to_build),
        "seconds": time.perf_counter() - t0,
    }
