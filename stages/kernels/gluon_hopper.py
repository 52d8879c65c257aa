"""What the Gluon kernels (gluon_moe_fp8, gluon_indexer) share: whether Gluon's Hopper ops load
on this device, and the shared-memory layout of an e4m3 tile (a TMA descriptor's)."""

from __future__ import annotations

from typing import Any

import torch


def is_available() -> bool:
    try:
        import triton.experimental.gluon.language.nvidia.hopper  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def fp8_layout(block_shape: list[int]) -> Any:
    """The NVMMA shared layout (the widest swizzle the tile allows) of an e4m3 block."""
    from triton.experimental.gluon import language as gl

    return gl.NVMMASharedLayout.get_default_for(block_shape, gl.float8e4nv)
