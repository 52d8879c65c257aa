"""DeepSeek-V3.2's lightning-indexer key in FP8, as an FP8 cache stores it: per token the
index_head_dim values as float8_e4m3, then one float32 scale (index_head_dim + 4 bytes: 132 for
V3.2's 128; the scale 4-byte aligned, so it reads as a float32 in place).

The scale rule is DeepSeek's own inference code for V3.2 (its indexer quantizes the key with
``act_quant`` in 1 x 128 groups under the checkpoint's ``scale_fmt: ue8m0``, which vLLM's and
SGLang's indexer caches follow): the group's amax (at least 1e-4) over e4m3's 448, rounded up to
a power of two, the rule ``fp8_latent.pow2_scale`` already implements for the latent. At
index_head_dim <= 128 the group is the whole key: one scale per token (wider keys would need one
per group: stages.models.deepseek_config refuses them). A power-of-two scale is exact to apply,
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


def quantize(keys: torch.Tensor) -> torch.Tensor:
    """[T, D] (any float dtype) -> [T, D + 4] uint8 in the layout above."""
    t, dim = keys.shape
    if dim % SCALE_BYTES:
        raise ValueError(f"the FP8 indexer key's width must be a multiple of 4, got {dim}")
    out = torch.empty(t, dim + SCALE_BYTES, dtype=torch.uint8, device=keys.device)
    values = keys.float()
    scale = fp8_latent.pow2_scale(values.abs().amax(dim=-1))  # [T]
    out[:, :dim] = (values / scale[:, None]).to(torch.float8_e4m3fn).view(torch.uint8)
    out[:, dim:] = scale[:, None].view(torch.uint8)
    return out


def dequantize(packed: torch.Tensor) -> torch.Tensor:
    """[T, D + 4] uint8 -> [T, D] float32 (exact: e4m3 values times a power of two)."""
    dim = packed.shape[-1] - SCALE_BYTES
    values = packed[:, :dim].contiguous().view(torch.float8_e4m3fn).float()
    scale = packed[:, dim:].contiguous().view(torch.float32)  # [T, 1]
    return values * scale


def quantize_queries(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, H, D] -> (e4m3 [T, H, D], float32 scales [T, H]): one power-of-two scale per query
    head, the keys' rule."""
    values = q.float()
    scale = fp8_latent.pow2_scale(values.abs().amax(dim=-1))
    return (values / scale[..., None]).to(torch.float8_e4m3fn), scale
