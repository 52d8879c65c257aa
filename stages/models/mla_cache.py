"""Paged cache of MLA latents: one stage's layers, the same block ids as every other stage.

Each layer holds named per-token components side by side, each its own tensor
[num_blocks, block_size, 1, width] (FlashMLA's page layout for the latent): the latent
(kv_lora_rank + qk_rope_head_dim values) and, for DeepSeek-V3.2, its lightning indexer's key
(index_head_dim values), paged under the same block ids. Bytes per token per layer is the sum of
the widths, so the scheduler's block budget (admission) counts both.
"""

from __future__ import annotations

import torch

from stages.model_config import ModelArgs
from stages.models.deepseek_config import LATENT, latent_components


class LatentKVCache:
    def __init__(self, args: ModelArgs, num_local_layers: int, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: str | torch.device):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got "
                             f"{num_blocks}, {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.components = {
            name: [torch.zeros(num_blocks, block_size, 1, width, dtype=dtype, device=device)
                   for _ in range(num_local_layers)]
            for name, width in latent_components(args).items()}

    def pages(self, local_layer: int, name: str = LATENT) -> torch.Tensor:
        """[num_blocks, block_size, 1, width]: what a paged kernel (FlashMLA) reads."""
        return self.components[name][local_layer]

    def _flat(self, local_layer: int, name: str) -> torch.Tensor:
        t = self.components[name][local_layer]
        return t.view(-1, t.shape[-1])  # [slots, width]

    def write(self, local_layer: int, values: torch.Tensor, slot_mapping: torch.Tensor,
              name: str = LATENT) -> None:
        """Store values [T, width] at slots [T]."""
        flat = self._flat(local_layer, name)
        flat.index_copy_(0, slot_mapping, values.to(flat.dtype))

    def gather(self, local_layer: int, idx: torch.Tensor | slice,
               name: str = LATENT) -> torch.Tensor:
        """[L, width] of a row's prefix: idx its slots, or a slice (consecutive blocks: a view)."""
        flat = self._flat(local_layer, name)
        return flat[idx] if isinstance(idx, slice) else flat.index_select(0, idx)
