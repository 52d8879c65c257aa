"""DeepSeek-V4's FP8 KV pages (stages/kernels/fp8_v4_layout.py's 584-byte layout) in torch: pack
and unpack, quantize-on-write and reads at slot ids, and the torch reference of the FP8 sparse
attention (the pages dequantized, then torch_ref.sparse_sink_attention).

A component's pages are [num_blocks, P, 1, 584] (P entries per block) over padded blocks of bytes;
an entry's slot is block * P + offset, as in every other cache component.
"""

from __future__ import annotations

from typing import Any

import torch

from stages.kernels import fp8_latent, torch_ref
from stages.kernels.fp8_v4_layout import (
    ENTRY_BYTES,
    HEAD_DIM,
    NOPE,
    SCALE_BYTES,
    TILE,
    TILES,
    VALUE_BYTES,
    block_bytes,
)


def is_available(device: str) -> bool:
    return True


def allocate(num_blocks: int, entries: int, device: str | torch.device) -> torch.Tensor:
    """Zeroed pages of one component, P = entries per block: [num_blocks, P, 1, 584]
    float8_e4m3fn over [num_blocks, block_bytes(P)] bytes, the view FlashMLA checks (it
    addresses the values and scales itself, from P and the block stride)."""
    raw = torch.zeros(num_blocks, block_bytes(entries), dtype=torch.uint8, device=device)
    view = raw.as_strided(
        (num_blocks, entries, 1, ENTRY_BYTES), (raw.stride(0), ENTRY_BYTES, ENTRY_BYTES, 1)
    )
    return view.view(torch.float8_e4m3fn)


def quantize(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, 512] (any float dtype) -> (value bytes [T, 576], scale bytes [T, 8]) uint8."""
    if values.shape[-1] != HEAD_DIM:
        raise ValueError(
            f"the V4 FP8 layout holds {HEAD_DIM} values per entry, got {values.shape[-1]}"
        )
    t = values.shape[0]
    nope = values[:, :NOPE].float().view(t, TILES, TILE)
    scale = fp8_latent.pow2_scale(nope.abs().amax(dim=-1))  # [T, TILES]
    rows = torch.empty(t, VALUE_BYTES, dtype=torch.uint8, device=values.device)
    rows[:, :NOPE] = (
        (nope / scale[..., None]).view(t, NOPE).to(torch.float8_e4m3fn).view(torch.uint8)
    )
    rows[:, NOPE:] = values[:, NOPE:].to(torch.bfloat16).contiguous().view(torch.uint8)
    scales = torch.zeros(t, SCALE_BYTES, dtype=torch.uint8, device=values.device)
    # e8m0 is the exponent field of the float32 power of two
    scales[:, :TILES] = ((scale.view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
    return rows, scales


def dequantize(rows: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(value bytes [T, 576], scale bytes [T, 8]) -> [T, 512] bf16 (exact: fp8 times 2^k)."""
    t = rows.shape[0]
    nope = rows[:, :NOPE].contiguous().view(torch.float8_e4m3fn).float().view(t, TILES, TILE)
    scale = (scales[:, :TILES].int() << 23).view(torch.float32)
    rope = rows[:, NOPE:].contiguous().view(torch.bfloat16)
    return torch.cat(((nope * scale[..., None]).view(t, NOPE).bfloat16(), rope), dim=-1)


def _parts(pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Views [num_blocks, P, 576] of the value bytes and [num_blocks, P, 8] of the scales of
    pages [num_blocks, P, 1, 584]."""
    raw = pages.view(torch.uint8)
    n, entries, stride, at = raw.shape[0], raw.shape[1], raw.stride(0), raw.storage_offset()
    rows = raw.as_strided((n, entries, VALUE_BYTES), (stride, VALUE_BYTES, 1), at)
    scales = raw.as_strided(
        (n, entries, SCALE_BYTES), (stride, SCALE_BYTES, 1), at + entries * VALUE_BYTES
    )
    return rows, scales


def write_reference(pages: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
    """Quantize values [T, 512] into the entries at slots [T] of pages [blocks, P, 1, 584]."""
    rows, scales = quantize(values)
    row_view, scale_view = _parts(pages)
    block, offset = slots // pages.shape[1], slots % pages.shape[1]
    row_view[block, offset] = rows
    scale_view[block, offset] = scales


def read(pages: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[T, 512] bf16: the entries at slots [T] of pages [blocks, P, 1, 584], dequantized."""
    row_view, scale_view = _parts(pages)
    block, offset = slots // pages.shape[1], slots % pages.shape[1]
    return dequantize(row_view[block, offset], scale_view[block, offset])


def sparse_sink_attention(
    q: torch.Tensor,
    window_pages: torch.Tensor,
    window: torch.Tensor,
    comp_pages: torch.Tensor | None,
    comp: torch.Tensor | None,
    sinks: torch.Tensor,
    scale: float,
    state: dict[str, Any] | None = None,
    window_state: dict[str, Any] | None = None,
    schedule_state: dict[str, Any] | None = None,
    comp_counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """torch_ref.sparse_sink_attention over FP8 pages [blocks, P, 1, 584], read in place:
    query t attends to the window entries at slots window[t] and the compressed ones at
    comp[t] (-1: none). Only the slots some query names are dequantized. -> [T, H, 512] in
    q's dtype. state / window_state / schedule_state, comp_counts: what a kernel backend
    keeps between calls and may take for granted (stages/kernels/flash_mla_v4.py; unused
    here)."""
    pools, parts, base = [], [], 0
    for pages, idx in ((window_pages, window), (comp_pages, comp)):
        if pages is None or idx is None:
            continue
        used = idx >= 0
        slots, local = torch.unique(idx[used].long(), return_inverse=True)
        remapped = torch.full_like(idx, -1)
        remapped[used] = (local + base).to(idx.dtype)
        pools.append(read(pages, slots).to(q.dtype))
        parts.append(remapped)
        base += len(slots)
    indices = torch.cat(parts, dim=1)
    if len(parts) == 2 and parts[0].shape == parts[1].shape:
        # V4's traced addresses name each column's key in one of the two (the other -1): one
        # column each, the gathered pool's width and order, so the same arithmetic as over it
        both = (parts[0] >= 0) & (parts[1] >= 0)
        if not bool(both.any()):
            indices = torch.where(parts[0] >= 0, parts[0], parts[1])
    return torch_ref.sparse_sink_attention(q, torch.cat(pools), indices, sinks, scale)
