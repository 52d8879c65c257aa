"""Paged KV cache of one stage: its own layers, the same block ids as every other stage."""

from __future__ import annotations

from typing import Protocol

import torch

from stages.model_config import ModelArgs
from stages.models.families import fp8_components


def _layers(layers: int | range) -> range:
    """A stage's layers: an int counts layers that all cost the same (a uniform family)."""
    return range(layers) if isinstance(layers, int) else layers


def layer_bytes_per_block(
    args: ModelArgs, layer: int, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto"
) -> int:
    """Bytes one block costs in one layer: each component's entries of the block (one per token,
    or one per group of tokens) times its width (FP8-packed components at their packed size,
    as the family's layout pads the block)."""
    elem = torch.empty((), dtype=dtype).element_size()
    packed = fp8_components(args, kv_cache_dtype)
    return sum(
        args.family.fp8_block_bytes(name, packed[name], block_size // per)
        if name in packed
        else width * elem * (block_size // per)
        for name, (width, per) in args.family.components_of_layer(args, layer).items()
    )


def bytes_per_token_layer(args: ModelArgs, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    """Cache bytes one token costs in one layer: the family's cache components together (for a
    family whose layers differ, the mean over the model's layers, rounded)."""
    block = args.family.block_multiple(args)
    layers = range(args.num_hidden_layers)
    return round(
        bytes_per_block(args, layers, block, dtype, kv_cache_dtype) / (block * len(layers))
    )


def bytes_per_block(
    args: ModelArgs,
    layers: int | range,
    block_size: int,
    dtype: torch.dtype,
    kv_cache_dtype: str = "auto",
) -> int:
    """Bytes one block costs on a stage holding `layers` (a count, or the range for a family
    whose layers differ)."""
    return sum(
        layer_bytes_per_block(args, i, block_size, dtype, kv_cache_dtype) for i in _layers(layers)
    )


def check_block_size(args: ModelArgs, block_size: int) -> None:
    multiple = args.family.block_multiple(args)
    if block_size < 1 or block_size % multiple:
        raise ValueError(
            f"{args.model_type} needs a block size that is a multiple of "
            f"{multiple} (its largest compression rate: whole groups per block), "
            f"got {block_size}"
        )


class KVCache(Protocol):
    """What every family's cache class has (PagedKVCache's K/V pages, MLA's latent pages,
    DeepSeek-V4's per-layer components): the runner and the decode graphs read these; the
    family's layers, which know their own class, read the rest."""

    @property
    def num_blocks(self) -> int: ...

    @property
    def block_size(self) -> int: ...


def make_kv_cache(
    args: ModelArgs,
    layers: int | range,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: str | torch.device,
    kv_cache_dtype: str = "auto",
) -> KVCache:
    """The cache class the model family declares (K/V pages, MLA latent pages, ...); a family
    whose layers differ gets the stage's layer range, the others its layer count; a class with
    an FP8 form (the family's `fp8_kv`) takes kv_cache_dtype="fp8"."""
    check_block_size(args, block_size)
    span = _layers(layers) if args.family.layer_kv_components is not None else len(_layers(layers))
    extra = {"kv_cache_dtype": "fp8"} if fp8_components(args, kv_cache_dtype) else {}
    cache: KVCache = args.family.cache()(args, span, num_blocks, block_size, dtype, device, **extra)
    return cache


class PagedKVCache:
    """K/V for the stage's layers as one tensor [L, 2, num_blocks * block_size, Hkv, D].

    A token at position p of a request lives in slot block_table[p // B] * B + p % B.
    """

    def __init__(
        self,
        args: ModelArgs,
        num_local_layers: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: str | torch.device,
    ):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.kv = torch.zeros(
            num_local_layers,
            2,
            num_blocks * block_size,
            args.num_key_value_heads,
            args.head_dim,
            dtype=dtype,
            device=device,
        )

    def write(
        self, local_layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Store k, v [T, Hkv, D] at slots [T]."""
        layer = self.kv[local_layer]
        layer[0].index_copy_(0, slot_mapping, k.to(layer.dtype))
        layer[1].index_copy_(0, slot_mapping, v.to(layer.dtype))

    def slots(self, block_table: list[int], length: int) -> torch.Tensor:
        """Slot ids of positions 0..length-1 for a request with this block table."""
        b = self.block_size
        needed = -(-length // b)
        if needed > len(block_table):
            raise ValueError(
                f"block table has {len(block_table)} blocks, {length} tokens need {needed}"
            )
        blocks = torch.tensor(block_table[:needed], dtype=torch.long, device=self.kv.device)
        offsets = torch.arange(b, dtype=torch.long, device=self.kv.device)
        return (blocks[:, None] * b + offsets[None, :]).reshape(-1)[:length]

    def gather(
        self,
        local_layer: int,
        block_table: list[int],
        length: int,
        idx: torch.Tensor | slice | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [length, Hkv, D] of positions 0..length-1, in order (idx: precomputed slots, or
        a slice when the blocks are consecutive: then K and V are views, nothing is copied)."""
        if isinstance(idx, slice):
            layer = self.kv[local_layer]
            return layer[0][idx], layer[1][idx]
        if idx is None:
            idx = self.slots(block_table, length)
        layer = self.kv[local_layer]
        return layer[0].index_select(0, idx), layer[1].index_select(0, idx)

    def gather_padded(
        self, local_layer: int, slots: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [R, Lmax, Hkv, D] of a [R, Lmax] slot matrix (a padded group of rows)."""
        layer = self.kv[local_layer]
        flat = slots.reshape(-1)
        shape = (*slots.shape, *layer.shape[2:])
        k, v = layer[0].index_select(0, flat), layer[1].index_select(0, flat)
        return k.view(shape), v.view(shape)
