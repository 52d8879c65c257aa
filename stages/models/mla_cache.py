"""Paged cache of MLA latents: one stage's layers, the same block ids as every other stage.

Each layer holds named per-token components side by side, each its own tensor
[num_blocks, block_size, 1, width] (FlashMLA's page layout for the latent): the latent
(kv_lora_rank + qk_rope_head_dim values) and, for DeepSeek-V3.2, its lightning indexer's key
(index_head_dim values), paged under the same block ids. Bytes per token per layer is the sum of
the widths, so the scheduler's block budget (admission) counts both.
"""

from __future__ import annotations

import torch

from stages.kernels import fp8_latent, triton_fp8_latent
from stages.model_config import ModelArgs
from stages.models.deepseek_config import INDEXER_KEY, LATENT, latent_components
from stages.models.families import fp8_components


class LatentKVCache:
    """kv_cache_dtype "fp8" (DeepSeek-V3.2): the latent is stored in FlashMLA's 656-byte FP8
    layout (stages/kernels/fp8_latent.py), the indexer key as e4m3 values and a float32 scale in
    stages/kernels/fp8_indexer.py's block layout: uint8 pages, quantized as they are written."""

    def __init__(
        self,
        args: ModelArgs,
        num_local_layers: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: str | torch.device,
        kv_cache_dtype: str = "auto",
    ):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}"
            )
        self.num_blocks, self.block_size = num_blocks, block_size
        self.packed = fp8_components(args, kv_cache_dtype)  # FP8 component -> bytes per token
        self.components = {
            name: [
                torch.zeros(
                    num_blocks,
                    block_size,
                    1,
                    self.packed.get(name, width),
                    dtype=torch.uint8 if name in self.packed else dtype,
                    device=device,
                )
                for _ in range(num_local_layers)
            ]
            for name, width in latent_components(args).items()
        }

    @property
    def fp8(self) -> bool:
        """The latent is FP8: attention reads it through the FP8 kernels (mla_sparse_fp8)."""
        return LATENT in self.packed

    def pages(self, local_layer: int, name: str = LATENT) -> torch.Tensor:
        """[num_blocks, block_size, 1, width]: what a paged kernel (FlashMLA) reads."""
        return self.components[name][local_layer]

    def _flat(self, local_layer: int, name: str) -> torch.Tensor:
        t = self.components[name][local_layer]
        return t.view(-1, t.shape[-1])  # [slots, width]

    def write(
        self, local_layer: int, values: torch.Tensor, slot_mapping: torch.Tensor, name: str = LATENT
    ) -> None:
        """Store values [T, width] at slots [T]."""
        flat = self._flat(local_layer, name)
        if name == LATENT and name in self.packed:  # quantized as written (one fused kernel)
            triton_fp8_latent.write(flat, values, slot_mapping)
        elif name in self.packed:  # the indexer key, in its block layout
            triton_fp8_latent.write_indexer_key(self.pages(local_layer, name), values, slot_mapping)
        else:
            flat.index_copy_(0, slot_mapping, values.to(flat.dtype))

    def gather(
        self, local_layer: int, idx: torch.Tensor | slice, name: str = LATENT
    ) -> torch.Tensor:
        """[L, width] of a row's prefix: idx its slots, or a slice (consecutive blocks: a view);
        an FP8 latent dequantized."""
        if name == INDEXER_KEY and name in self.packed:
            raise ValueError("the FP8 indexer key is read where it is scored (fp8_indexer.read)")
        flat = self._flat(local_layer, name)
        out = flat[idx] if isinstance(idx, slice) else flat.index_select(0, idx)
        return fp8_latent.dequantize(out) if name in self.packed else out
