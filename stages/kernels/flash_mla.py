"""MLA dense decode on FlashMLA (DESIGN §7): the `sgl-flash-mla` wheel (1.0.0), whose SM90
kernels are its "legacy" half. Persistent (sized to the SM count), so a waiting NCCL recv costs
it a wave (DESIGN §1: x1.5-1.7), which is what makes it worth measuring under the skip.

``mla_decode`` matches ``stages.kernels.torch_ref.mla_decode``: one query per row over the bf16
latent pages [blocks, 64, 1, 576]. The scheduler plan FlashMLA builds on its first call is kept
in the batch's ``state`` and reused by every layer of the stage (same shapes and lengths). Pages
of another block size or dtype go to the torch reference. Install on the GPU host with
``pip install --no-deps sgl-flash-mla`` (its metadata asks for a newer torch than it needs).
"""

from __future__ import annotations

import importlib

import torch

from stages.kernels import torch_ref

PAGE = 64  # FlashMLA's page size
MODULES = ("flash_mla", "sgl_flash_mla")


def _module():
    for name in MODULES:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    return None


def is_available(device: str = "cuda") -> bool:
    """A CUDA device of compute capability 9.x (the legacy SM90 kernels) and the wheel."""
    if not str(device).startswith("cuda") or not torch.cuda.is_available():
        return False
    if torch.cuda.get_device_capability()[0] != 9:
        return False
    return _module() is not None


def mla_decode(q: torch.Tensor, pages: torch.Tensor, block_table: torch.Tensor,
               seqlens: torch.Tensor, dv: int, scale: float, state: dict) -> torch.Tensor:
    """q [R, H, 576] bf16, pages [blocks, 64, 1, 576] bf16 -> [R, H, dv]."""
    if q.dtype != torch.bfloat16 or pages.dtype != torch.bfloat16 or pages.shape[1] != PAGE:
        return torch_ref.mla_decode(q, pages, block_table, seqlens, dv, scale, state)
    fm = _module()
    meta = state.get("flash_mla")
    if meta is None:
        meta = state["flash_mla"] = (fm.FlashMLASchedMeta() if hasattr(fm, "FlashMLASchedMeta")
                                     else fm.get_mla_metadata()[0])
    out, _lse = fm.flash_mla_with_kvcache(
        q.unsqueeze(1).contiguous(), pages, block_table, seqlens, dv, meta,
        softmax_scale=scale, causal=True, use_legacy=True)
    return out.squeeze(1)
