"""DeepSeek-V4's paged cache: one stage's layers, the same block ids as every other stage.

Each layer keeps named components, each its own tensor [num_blocks, entries per block, width]:

- `kv`: every token's K=V latent (head_dim), from which the sliding window is read. Keeping
  every position (not a ring of `sliding_window`) makes a block self-contained, so prefix
  caching, preemption and several chunks in flight need nothing beyond the block table.
- compressed layers (rate r): `comp_in`, every token's compressor inputs (its kv and gate
  projections), and `comp`, one compressed entry per group of r tokens. A group split across
  chunks is completed by the chunk holding its last token, from the inputs the earlier chunks
  left in the cache: the compressor keeps no other per-request state.
- CSA layers also keep the indexer's `index_in` (its own compressor inputs) and `index_keys`
  (its compressed keys, one per group).

The block size must be a multiple of the largest rate: then every group's tokens and its
compressed entry live in one block, a full block holds only complete groups, and a prefix-cache
hit (which resumes at a block boundary) resumes at a group boundary with every entry before it
already computed; the CSA overlap (entry w also reads group w - 1's inputs) reads the cached
block's `comp_in`, so no compressor state is restored or recomputed.

With kv_cache_dtype "fp8", `kv` and `comp` (what attention reads) are stored in FlashMLA's
584-byte V4 layout (stages/kernels/fp8_v4.py), quantized as they are written; FlashMLA's sparse
FP8 decode reads them in place, at the addresses `addresses()` traces (see there). The indexer's
`index_keys` are FP8 indexer keys (stages/kernels/fp8_indexer.py: e4m3 values, a float32 scale
each, in their block layout), which the indexer's scores read in place.
"""

from __future__ import annotations

import copy

import torch

from stages.kernels import fp8_indexer, fp8_v4, triton_fp8_latent
from stages.model_config import ModelArgs
from stages.models.deepseek_v4.config import COMP, INDEX_KEYS, KV, layer_components
from stages.models.families import fp8_components


class V4Cache:
    def __init__(
        self,
        args: ModelArgs,
        layers: range,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: str | torch.device,
        kv_cache_dtype: str = "auto",
    ):
        a = args.family_args
        if num_blocks < 1 or block_size < 1 or block_size % a.max_rate:
            raise ValueError(
                f"need num_blocks >= 1 and a block size that is a multiple of "
                f"{a.max_rate}, got {num_blocks}, {block_size}"
            )
        self.num_blocks, self.block_size = num_blocks, block_size
        self.packed = fp8_components(args, kv_cache_dtype)  # FP8 component -> bytes per entry
        self.tracing = False  # addresses(): KV / COMP reads give the entries' addresses

        def component(name: str, width: int, per: int) -> torch.Tensor:
            if name == INDEX_KEYS and name in self.packed:  # [num_blocks, entries, D + 4]
                return fp8_indexer.allocate(num_blocks, block_size // per, width, device)
            if name in self.packed:  # [num_blocks, entries, 1, 584] FP8 pages
                return fp8_v4.allocate(num_blocks, block_size // per, device)
            return torch.zeros(num_blocks, block_size // per, width, dtype=dtype, device=device)

        self.layers: list[dict[str, torch.Tensor]] = [
            {
                name: component(name, width, per)
                for name, (width, per) in layer_components(a, i).items()
            }
            for i in layers
        ]

    @property
    def fp8(self) -> bool:
        """Attention reads FP8 pages (sparse_sink_attention_fp8)."""
        return KV in self.packed

    def pages(self, local_layer: int, name: str) -> torch.Tensor | None:
        """[num_blocks, entries per block, 1, 584]: an FP8 component as FlashMLA reads it (None
        where the layer has no such component)."""
        if name not in self.packed:
            raise ValueError(f"cache component {name!r} is not stored in FP8")
        return self.layers[local_layer].get(name)

    def component(self, local_layer: int, name: str) -> torch.Tensor:
        """The component's tensor as stored, [num_blocks, entries per block, ...]: slot s is
        entry s % entries of block s // entries."""
        return self.layers[local_layer][name]

    def flat(self, local_layer: int, name: str) -> torch.Tensor:
        """[num_blocks * entries per block, width]: addressed by `slots`."""
        t = self.layers[local_layer][name]
        return t.view(-1, t.shape[-1])

    def write(self, local_layer: int, name: str, values: torch.Tensor, slots: torch.Tensor) -> None:
        if name == INDEX_KEYS and name in self.packed:
            triton_fp8_latent.write_indexer_key(self.layers[local_layer][name], values, slots)
            return
        if name in self.packed:  # quantized as it is written (one fused kernel on CUDA)
            triton_fp8_latent.write_v4(self.layers[local_layer][name], values, slots)
            return
        flat = self.flat(local_layer, name)
        flat.index_copy_(0, slots, values.to(flat.dtype))

    def write_token_rows(
        self, local_layer: int, rows: dict[str, torch.Tensor], slots: torch.Tensor
    ) -> None:
        """What every token writes, by component (its latent `kv`, the compressors' inputs):
        on FP8 pages one launch for all of them (the latent quantized, the inputs copied
        beside it, triton_fp8_latent.write_v4's rows), else one write each."""
        plain = [name for name in rows if name != KV]
        if KV in self.packed and not set(plain) & set(self.packed):
            copies = []
            for name in plain:
                flat = self.flat(local_layer, name)
                copies.append((flat, rows[name].to(flat.dtype)))
            triton_fp8_latent.write_v4(self.layers[local_layer][KV], rows[KV], slots, tuple(copies))
            return
        for name, values in rows.items():
            self.write(local_layer, name, values, slots)

    def read(self, local_layer: int, name: str, slots: torch.Tensor) -> torch.Tensor:
        if self.tracing and name in (KV, COMP):
            return self._address(name, slots)[:, None]
        if name == INDEX_KEYS and name in self.packed:
            return fp8_indexer.read(self.layers[local_layer][name], slots)
        if name in self.packed:
            return fp8_v4.read(self.layers[local_layer][name], slots)
        return self.flat(local_layer, name).index_select(0, slots)

    def addresses(self) -> V4Cache:
        """This cache (the same tensors) reading each `kv` / `comp` entry as its address, [n, 1]
        long: `kv` slot s as s, `comp` slot s as kv_slots + s; every other component as usual.
        Run over it, the code that gathers a pool of keys (V4Attention._keys) and indices into
        it tells, through pool[indices], which entry of which page each query attends to: what
        FlashMLA's FP8 decode reads in place, with no copy of the pool."""
        view = copy.copy(self)
        view.tracing = True
        return view

    def split_addresses(
        self, pool: torch.Tensor, indices: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(window, comp) [T, K] int32 slot ids (-1: none) of the traced pool [N, 1] and
        indices [T, K] into it (-1: none)."""
        kv_slots = self.num_blocks * self.block_size
        a = torch.where(indices >= 0, pool[:, 0][indices.clamp(min=0).long()], -1)
        window = torch.where((a >= 0) & (a < kv_slots), a, -1)
        comp = torch.where(a >= kv_slots, a - kv_slots, -1)
        return window.int(), comp.int()

    def _address(self, name: str, slots: torch.Tensor) -> torch.Tensor:
        return slots.long() + (self.num_blocks * self.block_size if name == COMP else 0)
