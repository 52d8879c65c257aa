"""Paged KV cache of one stage: its own layers, the same block ids as every other stage."""

from __future__ import annotations

import torch

from stages.model_config import ModelArgs
from stages.protocol import KV_CACHE_DTYPES


def fp8_components(args: ModelArgs, kv_cache_dtype: str) -> dict[str, int]:
    """Components the cache stores packed in FP8 -> their bytes per token per layer; {} for
    an unquantized cache ("auto" / "bfloat16": the model's dtype). Refuses, with the reason, a
    model whose family has no FP8 cache."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got "
                         f"{kv_cache_dtype!r}")
    if kv_cache_dtype != "fp8":
        return {}
    if args.family.fp8_kv is None:
        raise ValueError(f"--kv-cache-dtype fp8 is not supported for the {args.family.name} "
                         "family (only DeepSeek-V3.2's FP8 latent)")
    return args.family.fp8_kv(args)


def bytes_per_token_layer(args: ModelArgs, dtype: torch.dtype,
                          kv_cache_dtype: str = "auto") -> int:
    """Cache bytes one token costs in one layer: the family's cache components together (FP8
    ones at their packed size)."""
    elem = torch.empty((), dtype=dtype).element_size()
    packed = fp8_components(args, kv_cache_dtype)
    return sum(packed.get(name, width * elem)
               for name, width in args.family.kv_components(args).items())


def bytes_per_block(args: ModelArgs, num_local_layers: int, block_size: int,
                    dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    """Bytes one block costs on a stage holding `num_local_layers` layers."""
    return num_local_layers * block_size * bytes_per_token_layer(args, dtype, kv_cache_dtype)


def make_kv_cache(args: ModelArgs, num_local_layers: int, num_blocks: int, block_size: int,
                  dtype: torch.dtype, device: str | torch.device, kv_cache_dtype: str = "auto"):
    """The cache class the model family declares (K/V pages, MLA latent pages, ...); a class
    with an FP8 form (the family's `fp8_kv`) takes kv_cache_dtype="fp8"."""
    extra = {"kv_cache_dtype": "fp8"} if fp8_components(args, kv_cache_dtype) else {}
    return args.family.cache()(args, num_local_layers, num_blocks, block_size, dtype, device,
                               **extra)


class PagedKVCache:
    """K/V for the stage's layers as one tensor [L, 2, num_blocks * block_size, Hkv, D].

    A token at position p of a request lives in slot block_table[p // B] * B + p % B.
    """

    def __init__(self, args: ModelArgs, num_local_layers: int, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: str | torch.device):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got "
                             f"{num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.kv = torch.zeros(num_local_layers, 2, num_blocks * block_size,
                              args.num_key_value_heads, args.head_dim, dtype=dtype, device=device)

    def write(self, local_layer: int, k: torch.Tensor, v: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
        """Store k, v [T, Hkv, D] at slots [T]."""
        layer = self.kv[local_layer]
        layer[0].index_copy_(0, slot_mapping, k.to(layer.dtype))
        layer[1].index_copy_(0, slot_mapping, v.to(layer.dtype))

    def slots(self, block_table: list[int], length: int) -> torch.Tensor:
        """Slot ids of positions 0..length-1 for a request with this block table."""
        b = self.block_size
        needed = -(-length // b)
        if needed > len(block_table):
            raise ValueError(f"block table has {len(block_table)} blocks, {length} tokens "
                             f"need {needed}")
        blocks = torch.tensor(block_table[:needed], dtype=torch.long, device=self.kv.device)
        offsets = torch.arange(b, dtype=torch.long, device=self.kv.device)
        return (blocks[:, None] * b + offsets[None, :]).reshape(-1)[:length]

    def gather(self, local_layer: int, block_table: list[int], length: int,
               idx: torch.Tensor | slice | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [length, Hkv, D] of positions 0..length-1, in order (idx: precomputed slots, or
        a slice when the blocks are consecutive: then K and V are views, nothing is copied)."""
        if isinstance(idx, slice):
            layer = self.kv[local_layer]
            return layer[0][idx], layer[1][idx]
        if idx is None:
            idx = self.slots(block_table, length)
        layer = self.kv[local_layer]
        return layer[0].index_select(0, idx), layer[1].index_select(0, idx)

    def gather_padded(self, local_layer: int,
                      slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [R, Lmax, Hkv, D] of a [R, Lmax] slot matrix (a padded group of rows)."""
        layer = self.kv[local_layer]
        flat = slots.reshape(-1)
        shape = (*slots.shape, *layer.shape[2:])
        k, v = layer[0].index_select(0, flat), layer[1].index_select(0, flat)
        return k.view(shape), v.view(shape)
