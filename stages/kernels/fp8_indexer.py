"""The lightning indexer's key in FP8, as an FP8 cache stores it (DeepSeek-V3.2's and V4's CSA
indexer): per key index_head_dim values as float8_e4m3 and one float32 scale, laid out per page
block of E entries, not per key: the block's E x D value bytes first (entry e at e D), then its
E float32 scales (entry e at E D + 4 e). D + 4 bytes a key, as before (132 for D = 128), but every
key's values start 16-byte aligned (D a multiple of 16, E a multiple of 4), so a kernel gathering
keys by slot reads whole vectors: with the scale after each key's values (132-byte rows) the
decode rows' gathers were byte loads, 3x slower than over bf16 keys (docs/PERFORMANCE.md).

The scale rule is DeepSeek's own inference code for V3.2 (its indexer quantizes the key with
``act_quant`` in 1 x 128 groups under the checkpoint's ``scale_fmt: ue8m0``, which vLLM's and
SGLang's indexer caches follow): the group's amax (at least 1e-4) over e4m3's 448, rounded up to
a power of two, the rule ``fp8_latent.pow2_scale`` already implements for the latent. At
index_head_dim <= 128 the group is the whole key: one scale per key (wider keys would need one
per group: fp8_indexer_layout.key_bytes refuses them). A power-of-two scale is exact to apply,
so a score over the FP8 key times its scale equals the score over the dequantized key up to the
order of the sum.

Against FP8 keys the queries are scored in FP8 too, as DeepSeek's indexer does (``act_quant``
of q, then ``fp8_index``): each query head's index_head_dim values in e4m3 under the same
power-of-two rule (`quantize_queries`), its scale folded into the head's weight. relu(s x) =
s relu(x) for s > 0, so the score is the one over the dequantized query, and the products run on
FP8 tensor cores.
"""

from __future__ import annotations

import torch

from stages.kernels import fp8_latent
from stages.kernels.fp8_indexer_layout import SCALE_BYTES


def allocate(num_blocks: int, entries: int, dim: int, device: str | torch.device) -> torch.Tensor:
    """[num_blocks, entries, dim + 4] uint8 pages (zeros: every scale 0 until written)."""
    return torch.zeros(num_blocks, entries, dim + SCALE_BYTES, dtype=torch.uint8, device=device)


def pack(keys: torch.Tensor, entries: int) -> torch.Tensor:
    """Keys [T, D] quantized into fresh pages of `entries` entries a block, key i at slot i
    (benches and tests)."""
    pages = allocate(-(-keys.shape[0] // entries), entries, keys.shape[-1], keys.device)
    write_reference(pages, keys, torch.arange(keys.shape[0], device=keys.device))
    return pages


def split(pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of pages [B, E, D + 4] uint8 (or [B, E, 1, D + 4], FlashMLA's page shape):
    (values [B, E, D] float8_e4m3fn, scales [B, E] float32), in place."""
    blocks, entries, width = pages.shape[0], pages.shape[1], pages.shape[-1]
    dim = width - SCALE_BYTES
    flat = pages.view(blocks, entries * width)
    values = flat[:, : entries * dim].view(torch.float8_e4m3fn).view(blocks, entries, dim)
    return values, flat[:, entries * dim :].view(torch.float32)


def quantize(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, D] (any float dtype) -> (e4m3 [T, D], float32 scales [T]) under the rule above."""
    if keys.shape[-1] % SCALE_BYTES:
        raise ValueError(f"the FP8 indexer key's width must be a multiple of 4, got {keys.shape}")
    values = keys.float()
    scale = fp8_latent.pow2_scale(values.abs().amax(dim=-1))
    return (values / scale[:, None]).to(torch.float8_e4m3fn), scale


def dequantize(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """quantize's inverse: [T, D] float32 (exact: e4m3 values times a power of two)."""
    return values.float() * scales[..., None]


def _block_entry(pages: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    slots = slots.long()
    return slots // pages.shape[1], slots % pages.shape[1]


def write_reference(pages: torch.Tensor, keys: torch.Tensor, slots: torch.Tensor) -> None:
    """Quantize keys [T, D] into pages at slots [T] (block slot // E, entry slot % E)."""
    values, scales = split(pages)
    block, entry = _block_entry(pages, slots)
    q, scale = quantize(keys)
    values[block, entry] = q
    scales[block, entry] = scale


def read(pages: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[n, D] float32 of the keys at slots [n] (exact: e4m3 values times a power of two)."""
    values, scales = split(pages)
    block, entry = _block_entry(pages, slots)
    return dequantize(values[block, entry], scales[block, entry])


def quantize_queries(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, H, D] -> (e4m3 [T, H, D], float32 scales [T, H]): one power-of-two scale per query
    head, the keys' rule."""
    values = q.float()
    scale = fp8_latent.pow2_scale(values.abs().amax(dim=-1))
    return (values / scale[..., None]).to(torch.float8_e4m3fn), scale
