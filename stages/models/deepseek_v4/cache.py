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
"""

from __future__ import annotations

import torch

from stages.model_config import ModelArgs
from stages.models.deepseek_v4.config import layer_components


class V4Cache:
    def __init__(
        self,
        args: ModelArgs,
        layers: range,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: str | torch.device,
    ):
        a = args.family_args
        if num_blocks < 1 or block_size < 1 or block_size % a.max_rate:
            raise ValueError(
                f"need num_blocks >= 1 and a block size that is a multiple of "
                f"{a.max_rate}, got {num_blocks}, {block_size}"
            )
        self.num_blocks, self.block_size = num_blocks, block_size
        self.layers: list[dict[str, torch.Tensor]] = [
            {
                name: torch.zeros(num_blocks, block_size // per, width, dtype=dtype, device=device)
                for name, (width, per) in layer_components(a, i).items()
            }
            for i in layers
        ]

    def flat(self, local_layer: int, name: str) -> torch.Tensor:
        """[num_blocks * entries per block, width]: addressed by `slots`."""
        t = self.layers[local_layer][name]
        return t.view(-1, t.shape[-1])

    def write(self, local_layer: int, name: str, values: torch.Tensor, slots: torch.Tensor) -> None:
        flat = self.flat(local_layer, name)
        flat.index_copy_(0, slots, values.to(flat.dtype))

    def read(self, local_layer: int, name: str, slots: torch.Tensor) -> torch.Tensor:
        return self.flat(local_layer, name).index_select(0, slots)
