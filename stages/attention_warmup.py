"""Startup warm-up of what a long lone prompt's chunks would otherwise build in its TTFT:

- the prefill chunks' dense attention on cuDNN: one call on each (queries, keys) shape the
  chunks meet and on every diagonal square a chunk can need, over zero Q/K/V of the family's
  widths, so cuDNN's per-shape graphs (~50 ms each on H200) are built before a request needs
  them (docs/PERFORMANCE.md, "First requests");
- the sparse-attention indexer's Triton top-k: its compiled launches (1-2 s each) for lines up
  to the longest prompt's (stages/kernels/triton_topk.py, warm_up);
- the routed experts at each chunk length (the stage's warm_up_experts,
  stages/models/moe.py): the grouped MoE's Triton launches at its prefill tiles and, where
  moe_experts_fp8 is deepgemm, DeepGEMM's kernels, which its JIT compiles with nvcc at first
  use."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from stages.kernels.cudnn_attention import diagonal_sizes
from stages.models.families import ChunkAttentionDims


def warm_up_stage(
    family: Any,
    args: Any,
    kernels: Any,
    has_cache: bool,
    chunks: list[tuple[int, int]],
    dtype: torch.dtype,
    device: torch.device,
    layers: range,
) -> dict[str, float]:
    """A stage's warm-up for these (prefix, tokens) chunks: cuDNN's graphs where attention is
    cuDNN and the family has dense chunk attention, the top-k's compiles where the stage's
    layers select with the Triton top-k (Family.top_k_lines)."""
    out: dict[str, float] = {"shapes": 0, "seconds": 0.0}
    dims = family.chunk_attention_dims(args)
    if kernels.names["attention"] == "cudnn" and has_cache and dims is not None:
        out = build_chunk_attention_graphs(kernels.attention, dims, chunks, dtype, device)
    lines = family.top_k_lines(args, max((p + n for p, n in chunks), default=0), layers)
    if lines is not None and kernels.names.get("index_topk") == "triton":
        from stages.kernels import triton_topk

        k, widest = lines
        t0 = time.perf_counter()
        out["top_k_widths"] = float(triton_topk.warm_up(k, widest, device))
        out["seconds"] = out.get("seconds", 0.0) + time.perf_counter() - t0
    return out


@torch.inference_mode()
def build_chunk_attention_graphs(
    attention: Callable[..., Any],
    dims: ChunkAttentionDims,
    chunks: list[tuple[int, int]],
    dtype: torch.dtype,
    device: torch.device,
) -> dict[str, float]:
    """chunks: (prefix, tokens) pairs. V has the model's strides (cuDNN's graphs are per shape
    and stride). Shapes with more keys than a quarter of the free memory holds are left to the
    first request."""
    if not chunks:
        return {"shapes": 0, "seconds": 0.0}
    t0 = time.perf_counter()
    longest = max(n for _, n in chunks)
    shapes = {(n, p + n) for p, n in chunks}
    shapes |= {(s, s) for s in diagonal_sizes(longest)}  # a square: the diagonal alone
    free, _total = torch.cuda.mem_get_info(device)
    per_key = dims.kv_heads * (dims.qk_dim + dims.v_row) * dtype.itemsize
    max_keys = min(max(length for _, length in shapes), free // 4 // per_key)
    to_build = sorted((n, length) for n, length in shapes if length <= max_keys)
    if not to_build:
        return {"shapes": 0, "skipped": len(shapes), "seconds": 0.0}
    q, k, v = zero_qkv(dims, max(n for n, _ in to_build), max_keys, dtype, device)
    for n, length in to_build:
        attention(q[:n], k[:length], v[:length], dims.qk_dim**-0.5)
    torch.cuda.synchronize(device)
    del q, k, v
    torch.cuda.empty_cache()
    return {
        "shapes": len(to_build),
        "skipped": len(shapes) - len(to_build),
        "seconds": time.perf_counter() - t0,
    }


def zero_qkv(
    dims: ChunkAttentionDims, rows: int, keys: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Zero q [rows, heads, qk], k [keys, kv_heads, qk] and v [keys, kv_heads, v] laid out as
    the family's attention receives them (v the tail of rows v_row wide)."""
    d = dims
    q = torch.zeros(rows, d.heads, d.qk_dim, dtype=dtype, device=device)
    k = torch.zeros(keys, d.kv_heads, d.qk_dim, dtype=dtype, device=device)
    v = torch.zeros(keys, d.kv_heads, d.v_row, dtype=dtype, device=device)[..., -d.v_dim :]
    return q, k, v
